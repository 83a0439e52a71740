"""`python -m dataset.prepare`: bad input is reported by file and line, nothing is lost."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dataset import prepare
from dataset.samples import ALPACA, CHAT_QA, DOMAIN_TEXT

GOOD_CHAT = {"messages": [{"role": "user", "content": "Salut?"}, {"role": "assistant", "content": "Salut!"}]}


def chat(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def run(tokenizer_dir, out, *inputs, extra=()):
    args = ["--tokenizer", str(tokenizer_dir), "--seq-len", "64", "--out", str(out), "--quiet", *extra]
    for path in inputs:
        args += ["--input", str(path)]
    return prepare.main(args)


# (case, format, bad line as bytes, reason code, message fragment)
BAD_LINES = [
    ("malformed JSON", "text", b'{"text": "unterminated', "malformed_json", "malformed JSON"),
    ("blank line", "text", b"   ", "blank_line", "blank line"),
    ("not an object", "text", b"[1, 2]", "not_an_object", "expected a JSON object, got list"),
    ("missing field", "text", b'{"body": "x"}', "missing_field", "missing field 'text'"),
    ("wrong type", "text", b'{"text": 5}', "wrong_type", "field 'text' must be a string, got int"),
    ("invalid UTF-8", "text", b'{"text": "ab\xff"}', "invalid_utf8", "invalid UTF-8 at byte 12"),
    ("empty content", "messages", json.dumps(chat(("user", "Q"), ("assistant", " "))).encode(), "empty_content",
     "field messages[1].'content' is empty"),
    ("unknown role", "messages", json.dumps(chat(("user", "Q"), ("bot", "A"))).encode(), "unknown_role",
     "messages[1].role is 'bot'"),
    ("no assistant turn", "messages", json.dumps(chat(("system", "S"), ("user", "Q"))).encode(), "no_assistant_turn",
     "conversation has no assistant turn"),
    ("not ending with assistant", "messages",
     json.dumps(chat(("user", "Q"), ("assistant", "A"), ("user", "Q2"))).encode(), "not_ending_with_assistant",
     "conversation ends with a 'user' turn"),
    ("wrong turn order", "messages", json.dumps(chat(("user", "Q"), ("user", "Q2"), ("assistant", "A"))).encode(),
     "bad_turn_order", "messages[1] is 'user' but 'assistant' was expected"),
    ("turn not an object", "messages", b'{"messages": ["hi"]}', "wrong_type", "messages[0] must be an object"),
    ("alpaca without output", "alpaca", b'{"instruction": "Do it", "input": ""}', "missing_field",
     "missing field 'output'"),
]


@pytest.mark.parametrize("case, fmt, bad, reason, message", BAD_LINES, ids=[c[0] for c in BAD_LINES])
def test_bad_record_is_reported_with_file_and_line(tmp_path, tiny_model_dir, capsys, case, fmt, bad, reason, message):
    good = {"text": json.dumps({"text": "Un document bun."}), "messages": json.dumps(GOOD_CHAT),
            "alpaca": json.dumps({"instruction": "Spune da.", "input": "", "output": "Da."})}[fmt]
    path = tmp_path / "input.jsonl"
    path.write_bytes(good.encode() + b"\n" + bad + b"\n" + good.encode() + b"\n")
    out = tmp_path / "out"

    assert run(tiny_model_dir, out, path, extra=["--format", fmt]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: {message}" in err
    assert "Traceback" not in err and "--skip-invalid" in err
    assert not out.exists() and list(tmp_path.glob(".out.partial*")) == []

    assert run(tiny_model_dir, out, path, extra=["--format", fmt, "--skip-invalid", "--eval-fraction", "0"]) == 0
    records = json.loads((out / "stats.json").read_text())["records"]
    assert (records["read"], records["kept"], records["skipped"]) == (3, 2, 1)
    assert records["skipped_by_reason"] == {reason: 1}


def test_a_file_that_starts_with_a_byte_order_mark_is_read(tmp_path, tiny_model_dir):
    """A UTF-8 BOM (as Windows editors save) is read as no part of line 1's JSON."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps({"text": "Ceva."}) + "\n" + json.dumps({"text": "Altceva."}) + "\n")
                     .encode())
    assert run(tiny_model_dir, tmp_path / "out", path, extra=["--eval-fraction", "0"]) == 0
    records = json.loads((tmp_path / "out" / "stats.json").read_text())["records"]
    assert (records["read"], records["kept"], records["skipped"]) == (2, 2, 0)


def test_several_errors_are_reported_at_once(tmp_path, tiny_model_dir, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": 1}\n{"text": 2}\n{"text": 3}\n', encoding="utf-8")
    assert run(tiny_model_dir, tmp_path / "out", path, extra=["--format", "text"]) == 2
    err = capsys.readouterr().err
    assert all(f"{path}:{n}: field 'text' must be a string" in err for n in (1, 2, 3))


def test_max_errors_stops_early(tmp_path, tiny_model_dir, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text("[]\n" * 50, encoding="utf-8")
    assert run(tiny_model_dir, tmp_path / "out", path, extra=["--max-errors", "3"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:3:" in err and f"{path}:4:" not in err and "stopped after 3 problems" in err


def test_missing_and_empty_files(tmp_path, tiny_model_dir, capsys):
    assert run(tiny_model_dir, tmp_path / "out", tmp_path / "nope.jsonl") == 2
    assert f"{tmp_path / 'nope.jsonl'}: no such file" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert run(tiny_model_dir, tmp_path / "out", empty) == 2
    assert f"{empty}:0: empty file" in capsys.readouterr().err
    # Skipping it leaves nothing usable, which is still an error.
    assert run(tiny_model_dir, tmp_path / "out", empty, extra=["--skip-invalid"]) == 2
    assert "no usable records" in capsys.readouterr().err
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "Ceva."}) + "\n")
    assert run(tiny_model_dir, tmp_path / "out", empty, good, extra=["--skip-invalid"]) == 0
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["records"]["empty_files"] == [str(empty)]


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_overlong_conversations_follow_the_policy(tmp_path, tiny_model_dir, policy):
    path = tmp_path / "chat.jsonl"
    long_answer = "Cluj-Napoca este un oraș mare. " * 40
    path.write_text(
        "\n".join(json.dumps(r) for r in [GOOD_CHAT, chat(("user", "Spune mult."), ("assistant", long_answer))]) + "\n"
    )
    out = tmp_path / "out"
    assert run(tiny_model_dir, out, path, extra=["--overlong", policy, "--eval-fraction", "0"]) == 0
    records = json.loads((out / "stats.json").read_text())["records"]
    if policy == "truncate":
        assert (records["kept"], records["truncated"], records["skipped"]) == (2, 1, 0)
    else:
        assert (records["kept"], records["truncated"], records["skipped_by_reason"]) == (1, 0, {"overlong_dropped": 1})
    ids = np.load(out / "train" / "input_ids.npy")
    assert ids.shape[1] == 64


def test_outputs_manifest_and_stats(tmp_path, tiny_model_dir):
    out = tmp_path / "phase2"
    assert run(tiny_model_dir, out, CHAT_QA, ALPACA, extra=["--seed", "3"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    stats = json.loads((out / "stats.json").read_text())
    assert manifest["phase"] == 2 and manifest["seq_len"] == 64
    assert manifest["detected_formats"] == {str(CHAT_QA): "messages", str(ALPACA): "alpaca"}
    assert manifest["tokenizer"]["fingerprint"].startswith("sha256:")
    assert [s["path"] for s in manifest["sources"]] == [str(CHAT_QA), str(ALPACA)]
    assert all(len(s["sha256"]) == 64 for s in manifest["sources"])
    for split in ("train", "eval"):
        arrays = [np.load(out / split / f"{n}.npy", mmap_mode="r") for n in ("input_ids", "labels", "position_ids")]
        assert all(a.dtype == np.int32 and a.shape == (manifest["counts"][split], 64) for a in arrays)
    assert manifest["counts"]["eval"] > 0
    records = stats["records"]
    assert records["read"] == 216 + 123 == records["kept"] + records["skipped"]
    assert 0 < stats["fill_ratio"] <= 1


def test_same_seed_same_bytes_and_the_eval_split_moves_with_the_seed(tmp_path, tiny_model_dir):
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        assert run(tiny_model_dir, tmp_path / name, DOMAIN_TEXT, extra=["--seed", seed]) == 0
    read = lambda name: (tmp_path / name / "eval" / "input_ids.npy").read_bytes()
    assert read("a") == read("b") != read("c")
    assert (tmp_path / "a" / "train" / "labels.npy").read_bytes() == (
        tmp_path / "b" / "train" / "labels.npy"
    ).read_bytes()


def test_refuses_to_overwrite_without_force(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "out"
    assert run(tiny_model_dir, out, DOMAIN_TEXT) == 0
    assert run(tiny_model_dir, out, DOMAIN_TEXT) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert run(tiny_model_dir, out, DOMAIN_TEXT, extra=["--force"]) == 0


def test_phase_mismatch_is_an_error(tmp_path, tiny_model_dir, capsys):
    assert run(tiny_model_dir, tmp_path / "out", DOMAIN_TEXT, CHAT_QA) == 2
    assert (
        f"{CHAT_QA}: its records look like messages (phase 2 data) but this dataset is phase 1"
        in capsys.readouterr().err
    )
    assert run(tiny_model_dir, tmp_path / "out", CHAT_QA, extra=["--format", "messages", "--phase", "1"]) == 2
    assert "phase: format messages is phase 2 data" in capsys.readouterr().err


def test_plain_text_files_are_split_into_paragraphs(tmp_path, tiny_model_dir):
    path = tmp_path / "notes.txt"
    path.write_text("Primul paragraf.\ncontinuă aici.\n\n\nAl doilea paragraf.\n", encoding="utf-8")
    out = tmp_path / "out"
    assert run(tiny_model_dir, out, path, extra=["--eval-fraction", "0"]) == 0
    assert json.loads((out / "stats.json").read_text())["records"]["kept"] == 2


def test_yaml_config_with_flag_override_and_unknown_key(tmp_path, tiny_model_dir, capsys):
    config = tmp_path / "prep.yaml"
    config.write_text(
        f"inputs: [{DOMAIN_TEXT}]\ntokenizer: {tiny_model_dir}\nseq_len: 128\nout: {tmp_path / 'out'}\nquiet: true\n"
    )
    assert prepare.main(["--config", str(config), "--seq-len", "64"]) == 0
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["seq_len"] == 64
    config.write_text(config.read_text() + "seqlen: 3\n")
    assert prepare.main(["--config", str(config)]) == 2
    assert "unknown key(s) ['seqlen']" in capsys.readouterr().err


def test_hf_dataset_directory_and_parquet_with_column_mapping(tmp_path, tiny_model_dir):
    import datasets

    rows = [{"content": f"Documentul numărul {i} despre județul Cluj."} for i in range(20)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    for source, out in ((tmp_path / "ds", tmp_path / "o1"), (tmp_path / "rows.parquet", tmp_path / "o2")):
        assert run(tiny_model_dir, out, source, extra=["--format", "hf", "--column", "text=content"]) == 0
        stats = json.loads((out / "stats.json").read_text())
        assert stats["phase"] == 1 and stats["records"]["kept"] == 20


def test_records_over_max_record_chars_are_reported_or_counted_not_tokenized(tmp_path, tiny_model_dir, capsys):
    """Tokenizing needs ~100 bytes per character of a record, so one huge record once took
    gigabytes: a record over --max-record-chars is a problem with FILE:LINE, before tokenizing,
    in documents and conversations alike; with --skip-invalid it is counted."""
    text = tmp_path / "text.jsonl"
    text.write_text("\n".join(json.dumps({"text": t}) for t in ["scurt " * 10, "lung " * 400, "iar scurt " * 5]) + "\n")
    convo = tmp_path / "chat.jsonl"
    convo.write_text(
        json.dumps(GOOD_CHAT) + "\n" + json.dumps(chat(("user", "Q" * 900), ("assistant", "A" * 200))) + "\n"
    )
    limit = ["--max-record-chars", "1000"]
    assert run(tiny_model_dir, tmp_path / "a", text, extra=limit) == 2
    err = capsys.readouterr().err
    assert (
        f"{text}:2: 2,000 characters, over max_record_chars (1,000)" in err and "Split it into several records" in err
    )
    assert run(tiny_model_dir, tmp_path / "b", convo, extra=limit) == 2
    assert f"{convo}:2: 1,100 characters, over max_record_chars (1,000)" in capsys.readouterr().err
    assert run(tiny_model_dir, tmp_path / "c", text, extra=[*limit, "--skip-invalid"]) == 0
    records = json.loads((tmp_path / "c" / "stats.json").read_text())["records"]
    assert (records["read"], records["kept"], records["skipped_by_reason"]) == (3, 2, {"record_too_long": 1})
    assert run(tiny_model_dir, tmp_path / "d", text, extra=["--max-record-chars", "0"]) == 2
    assert "max_record_chars: must be an integer >= 1" in capsys.readouterr().err


def test_a_full_disk_is_an_error_and_leaves_nothing(tmp_path, tiny_model_dir, monkeypatch, capsys):
    import errno

    from dataset import shards

    def full(self, row):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(shards.NpyRowWriter, "write", full)
    assert run(tiny_model_dir, tmp_path / "out", DOMAIN_TEXT) == 3
    err = capsys.readouterr().err
    assert "No space left on device" in err and "nothing was written to" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # neither the output nor its staging directory


@pytest.mark.parametrize("content, message", [
    (None, "is a directory; --config takes a YAML file"),
    (b"\xff\xfe seq_len: 64\n", "not UTF-8 text (byte 0)"),
    (b"- inputs\n- out\n", "expected a mapping of option names to values, got a list"),
    (b"seq_len: [64\n", "invalid YAML"),
])
def test_a_prepare_config_that_is_not_a_mapping_is_named(tmp_path, tiny_model_dir, capsys, content, message):
    """The same reader as the run config's (utils/yaml_file.py): no traceback, no exit 3."""
    config = tmp_path / "prep.yaml"
    if content is None:
        config.mkdir()
    else:
        config.write_bytes(content)
    args = ["--config", str(config), "--tokenizer", str(tiny_model_dir), "--input", str(DOMAIN_TEXT),
            "--seq-len", "64", "--out", str(tmp_path / "out"), "--quiet"]
    assert prepare.main(args) == 2
    err = capsys.readouterr().err
    assert f"error: {config}: {message}" in err and "Traceback" not in err
