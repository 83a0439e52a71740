"""The download scripts' conversion, run offline on local stand-ins for the hub datasets."""

from __future__ import annotations

import json

import datasets

from dataset.formats import normalize_messages
from dataset.scripts import download_qna_dataset, download_text_dataset


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_wikipedia_rows_become_text_records(tmp_path, capsys):
    body = "Clujul este un județ din Transilvania. " * 10
    rows = [
        {"id": "1", "url": "u1", "title": "Cluj", "text": body},
        {"id": "2", "url": "u2", "title": "Stub", "text": "Prea scurt."},
        {"id": "3", "url": "u3", "title": "Gol", "text": "   "},
        {"id": "4", "url": "u4", "title": "Iași", "text": "Iași " + body},
    ]
    source = tmp_path / "wiki.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(source))
    out = tmp_path / "ro_wiki.jsonl"
    assert download_text_dataset.main(["--dataset", str(source), "--out", str(out)]) == 0
    records = read_jsonl(out)
    assert records == [{"text": f"Cluj\n\n{body.strip()}"}, {"text": "Iași\n\n" + ("Iași " + body).strip()}]
    assert "wrote 2 records" in capsys.readouterr().out
    assert download_text_dataset.main(["--dataset", str(source), "--out", str(out), "--limit", "1", "--force"]) == 0
    assert len(read_jsonl(out)) == 1


def test_ultrachat_rows_in_both_layouts_become_valid_conversations(tmp_path, capsys):
    source = tmp_path / "ultrachat.jsonl"
    rows = [
        {
            "prompt": "Q",
            "messages": [{"role": "user", "content": "Ce este Deltа?"}, {"role": "assistant", "content": "O deltă."}],
        },
        {"id": 7, "data": ["Unde e Clujul?", "În Transilvania.", "Și Iașiul?", "În Moldova."]},
        {"id": 8, "data": ["Doar o întrebare?"]},
        {"prompt": "bad", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]},
    ]
    source.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    out = tmp_path / "chat.jsonl"
    assert download_qna_dataset.main(["--dataset", str(source), "--out", str(out)]) == 0
    records = read_jsonl(out)
    assert len(records) == 2
    assert records[1]["messages"][2] == {"role": "user", "content": "Și Iașiul?"}
    for record in records:
        assert normalize_messages(record) == record["messages"]
    printed = capsys.readouterr().out
    assert "wrote 2 records" in printed and "empty_content: 1" in printed and "no_assistant_turn: 1" in printed


def test_missing_local_dataset_is_a_clear_error(tmp_path, capsys):
    assert (
        download_qna_dataset.main(["--dataset", str(tmp_path / "nowhere.jsonl"), "--out", str(tmp_path / "o.jsonl")])
        == 2
    )
    assert "no such file or directory" in capsys.readouterr().err
