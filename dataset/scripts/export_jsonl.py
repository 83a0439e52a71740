"""Shared by the download scripts: convert rows to our JSONL, count what was skipped and why."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from dataset.errors import DataError, InvalidRecord
from utils.interrupts import report_interrupted, stop_signals_unwind
from utils.output_guard import OutputConflict, claim_output, staged_file


def export_jsonl(
    rows: Iterable[dict], convert: Callable[[dict], dict], out: str | Path, limit: int | None = None
) -> dict:
    """Write convert(row) for each row (up to `limit` written) to `out`, atomically.

    `convert` raises InvalidRecord for a row it cannot use; such rows are counted by reason.
    Returns {"read", "written", "skipped": {reason: count}}.
    """
    read, written, skipped = 0, 0, Counter()
    with staged_file(out) as staging, open(staging, "w", encoding="utf-8") as f:
        for row in rows:
            if limit is not None and written >= limit:
                break
            read += 1
            try:
                record = convert(row)
            except InvalidRecord as err:
                skipped[err.reason] += 1
                continue
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            written += 1
        f.flush()
        os.fsync(f.fileno())
    return {"read": read, "written": written, "skipped": dict(skipped)}


def report(counts: dict, out: str | Path) -> str:
    skipped = ", ".join(f"{k}: {v}" for k, v in sorted(counts["skipped"].items())) or "none"
    return f"wrote {counts['written']} records to {out} ({counts['read']} read, skipped: {skipped})"


def run_export(rows: Callable[[], Iterable[dict]], convert: Callable[[dict], dict], out: str, limit: int | None,
               *, source: str, force: bool) -> int:
    """A download script's body: export, print the report, or the error (exit status 2). An
    existing `out` file is replaced only with force; `out` may never be (or hold) the source."""
    try:
        with stop_signals_unwind():  # SIGTERM unwinds as SIGINT does: what was staged is removed
            claim_output(out, force=force, command="the download script", inputs={"--dataset": source},
                         ours=lambda path: path.is_file())
            counts = export_jsonl(rows(), convert, out, limit)
    except (DataError, OutputConflict) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # SIGINT, or SIGTERM (utils/interrupts.py): what was staged is removed
        return report_interrupted(err, "the download script")
    print(report(counts, out))
    return 0
