"""Download Romanian Wikipedia as phase-1 text JSONL ({"text": ...} per article). Needs a network.

    python -m dataset.scripts.download_text_dataset --out data/raw/ro_wiki.jsonl --limit 50000

Streams the dataset (nothing is held in memory) and stops after --limit articles.
--dataset also takes a local file or `save_to_disk` directory with the same columns
(id, url, title, text), which is how the tests run it offline.
"""

from __future__ import annotations

import argparse
import sys

from dataset.errors import InvalidRecord
from dataset.hf_source import iter_hf_records
from dataset.scripts.export_jsonl import run_export

DEFAULT_DATASET = "wikimedia/wikipedia"
DEFAULT_CONFIG = "20231101.ro"


def wikipedia_to_record(row: dict, min_chars: int = 200) -> dict:
    """One article -> {"text": "Title\\n\\nBody"}; stubs shorter than min_chars are skipped."""
    text = row.get("text")
    if not isinstance(text, str) or not text.strip():
        raise InvalidRecord("empty_content", "article has no text")
    text = text.strip()
    if len(text) < min_chars:
        raise InvalidRecord("too_short", f"article shorter than {min_chars} characters")
    # The dataset's text has no heading; the title gives the article its subject.
    title = (row.get("title") or "").strip()
    return {"text": f"{title}\n\n{text}" if title else text}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output JSONL file")
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")
    parser.add_argument("--limit", type=int, default=None, help="stop after this many articles written")
    parser.add_argument(
        "--dataset", default=DEFAULT_DATASET, help=f"hub name or local path (default {DEFAULT_DATASET})"
    )
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"hub config (default {DEFAULT_CONFIG})")
    parser.add_argument("--split", default="train")
    parser.add_argument("--min-chars", type=int, default=200, help="skip articles shorter than this (default 200)")
    args = parser.parse_args(argv)
    rows = lambda: (row for _, row in iter_hf_records(args.dataset, args.split, args.config))
    return run_export(
        rows,
        lambda row: wikipedia_to_record(row, args.min_chars),
        args.out,
        args.limit,
        source=args.dataset,
        force=args.force,
    )


if __name__ == "__main__":
    sys.exit(main())
