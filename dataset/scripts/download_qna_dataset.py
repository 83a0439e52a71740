"""Download OpenLLM-Ro/ro_sft_ultrachat (Romanian UltraChat) as phase-2 `messages` JSONL. Needs a network.

    python -m dataset.scripts.download_qna_dataset --out data/raw/ro_ultrachat.jsonl --limit 20000

Rows with `messages: [{role, content}]` are kept as they are; rows in UltraChat's original
layout (`data: [user, assistant, user, ...]`) are converted. Every written conversation
passes the same validation `prepare` applies; the others are skipped and counted by reason.
--dataset also takes a local file or `save_to_disk` directory, which is how the tests run it.
"""

from __future__ import annotations

import argparse
import sys

from dataset.errors import InvalidRecord
from dataset.formats import normalize_messages
from dataset.hf_source import iter_hf_records
from dataset.scripts.export_jsonl import run_export

DEFAULT_DATASET = "OpenLLM-Ro/ro_sft_ultrachat"


def ultrachat_to_record(row: dict) -> dict:
    """One row -> {"messages": [...]}, validated; raises InvalidRecord with the reason otherwise."""
    # A column another row has but this one lacks arrives as None (datasets unifies schemas).
    if row.get("messages") is not None:
        record = {"messages": row["messages"]}
    elif isinstance(row.get("data"), list):
        roles = ("user", "assistant")
        record = {"messages": [{"role": roles[i % 2], "content": text} for i, text in enumerate(row["data"])]}
    else:
        raise InvalidRecord("missing_field", "row has neither 'messages' nor 'data'")
    return {"messages": normalize_messages(record)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output JSONL file")
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")
    parser.add_argument("--limit", type=int, default=None, help="stop after this many conversations written")
    parser.add_argument(
        "--dataset", default=DEFAULT_DATASET, help=f"hub name or local path (default {DEFAULT_DATASET})"
    )
    parser.add_argument("--split", default="train")
    args = parser.parse_args(argv)
    rows = lambda: (row for _, row in iter_hf_records(args.dataset, args.split))
    return run_export(rows, ultrachat_to_record, args.out, args.limit, source=args.dataset, force=args.force)


if __name__ == "__main__":
    sys.exit(main())
