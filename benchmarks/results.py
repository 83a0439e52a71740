"""bench.json is shared by the benchmarks: each one replaces its own sections only."""

from __future__ import annotations

import json
from pathlib import Path

from utils.atomic_io import atomic_write_json


def update_results(path: Path, section: str, values: dict) -> None:
    """Set `section` of the JSON object in `path` (created if missing) to `values`. Written
    atomically: an interrupted benchmark never loses the other benchmarks' sections."""
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[section] = values
    atomic_write_json(path, results)
