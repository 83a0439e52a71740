"""The bundled sample corpora (Romanian geography) used by the demo and the tests.

`generate_samples.py` renders them from hand-written facts; see its docstring.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

SAMPLES_DIR = Path(__file__).resolve().parent
DOMAIN_TEXT = SAMPLES_DIR / "domain_text.jsonl"  # phase 1: {"text": ...}
CHAT_QA = SAMPLES_DIR / "chat_qa.jsonl"  # phase 2: {"messages": [{role, content}, ...]}
ALPACA = SAMPLES_DIR / "alpaca.jsonl"  # phase 2: {"instruction", "input", "output"}
PREFERENCE_PAIRS = SAMPLES_DIR / "preference.jsonl"  # a preference phase: {"prompt", "chosen", "rejected"}


def iter_sample_texts() -> Iterator[str]:
    """Every piece of natural text in the bundled corpora (for training a tokenizer)."""
    for path in (DOMAIN_TEXT, CHAT_QA, ALPACA):
        with open(path, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                if "text" in record:
                    yield record["text"]
                elif "messages" in record:
                    for message in record["messages"]:
                        yield message["content"]
                else:
                    yield from (record[k] for k in ("instruction", "input", "output") if record[k])
