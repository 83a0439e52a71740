"""bench.json is shared by the benchmarks: each one replaces its own sections only."""

from __future__ import annotations

import json
from pathlib import Path


def update_results(path: Path, section: str, values: dict) -> None:
    """Set `section` of the JSON object in `path` (created if missing) to `values`."""
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[section] = values
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
