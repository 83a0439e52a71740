"""The bundled corpora: in sync with their generator, well-formed, and the sizes the demo needs."""

from __future__ import annotations

import json

from dataset import samples
from dataset.samples import generate_samples


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_committed_files_match_the_generator():
    rendered = generate_samples.render_all()
    # Every committed corpus comes from the generator: a generator that yields nothing fails here.
    assert set(rendered) == {path.name for path in samples.SAMPLES_DIR.glob("*.jsonl")}
    for name, records in rendered.items():
        assert records, f"the generator rendered no records for {name}"
        assert read_jsonl(samples.SAMPLES_DIR / name) == records, (
            f"{name} is out of date: run `python -m dataset.samples.generate_samples`"
        )


def test_domain_text_has_a_few_hundred_paragraphs():
    records = read_jsonl(samples.DOMAIN_TEXT)
    assert len(records) >= 200
    assert all(set(r) == {"text"} and len(r["text"]) > 20 for r in records)
    assert len({r["text"] for r in records}) == len(records)


def test_chat_conversations_are_well_formed():
    conversations = [r["messages"] for r in read_jsonl(samples.CHAT_QA)]
    assert len(conversations) >= 200
    assert sum(m[0]["role"] == "system" for m in conversations) >= 30
    assert sum(sum(t["role"] == "user" for t in m) >= 2 for m in conversations) >= 30  # multi-turn
    for messages in conversations:
        turns = [t for t in messages if t["role"] != "system"]
        assert [t["role"] for t in turns] == ["user", "assistant"] * (len(turns) // 2)
        assert all(t["content"].strip() for t in messages)


def test_alpaca_records_have_the_three_fields():
    records = read_jsonl(samples.ALPACA)
    assert len(records) >= 100
    assert all(set(r) == {"instruction", "input", "output"} and r["instruction"] and r["output"] for r in records)
    assert any(r["input"] == "" for r in records) and any(r["input"] for r in records)
