"""Durations as users write them in a config: 8h30m, 45m, 90s."""

from __future__ import annotations

import re


def parse_duration(text: str, key: str = "train.max_wall_time") -> float:
    """Seconds in "8h30m", "45m", "90s", "1h5m30s" or a plain number of seconds; ValueError
    naming `key` otherwise."""
    text = str(text).strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    if not text or match is None:
        raise ValueError(f"{key}: {text!r} is not a duration; write it like 8h30m, 45m or 90s")
    hours, minutes, seconds = (int(part or 0) for part in match.groups())
    return hours * 3600.0 + minutes * 60.0 + seconds
