"""Read input files record by record, streaming, with a line number for every record.

A reader yields `(line, value)` where value is the parsed record or a `RecordIssue` saying
why the line is unusable. Nothing is dropped silently: a blank line, invalid UTF-8 or a
malformed JSON line comes out as an issue, and the caller counts it.

Each reader also hashes the raw bytes it reads (sha256, for the manifest), so a multi-GB
input is read exactly once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from dataset.errors import DataError, RecordIssue


class SourceFile:
    """One input file: its path, and the sha256 and size of what was read from it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise DataError(f"{self.path}: no such file (check --input)")
        if not self.path.is_file():
            raise DataError(
                f"{self.path}: not a regular file (--input takes files; use --format hf for a dataset directory)"
            )
        self._hash = hashlib.sha256()
        self.bytes_read = 0

    def raw_lines(self) -> Iterator[tuple[int, bytes]]:
        """(1-based line number, raw bytes without the newline)."""
        with open(self.path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                self._hash.update(raw)
                self.bytes_read += len(raw)
                yield number, raw.rstrip(b"\r\n")

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()


def decode_line(source: SourceFile, number: int, raw: bytes) -> str | RecordIssue:
    """A line as text; the first may start with a UTF-8 byte order mark (Windows editors write
    one), which is not part of the data."""
    try:
        return raw.decode("utf-8-sig" if number == 1 else "utf-8")
    except UnicodeDecodeError as err:
        return RecordIssue(str(source.path), number, "invalid_utf8",
                           f"invalid UTF-8 at byte {err.start} of the line (re-encode the file as UTF-8)")


def iter_jsonl(source: SourceFile) -> Iterator[tuple[int, object]]:
    """One JSON object per line. Yields (line, dict) or (line, RecordIssue)."""
    for number, raw in source.raw_lines():
        text = decode_line(source, number, raw)
        if isinstance(text, RecordIssue):
            yield number, text
            continue
        if not text.strip():
            yield number, RecordIssue(str(source.path), number, "blank_line", "blank line (remove it)")
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            yield (
                number,
                RecordIssue(
                    str(source.path), number, "malformed_json", f"malformed JSON: {err.msg} at column {err.colno}"
                ),
            )
            continue
        if not isinstance(record, dict):
            yield number, RecordIssue(str(source.path), number, "not_an_object",
                                      f"expected a JSON object, got {type(record).__name__}")
            continue
        yield number, record


def iter_text_paragraphs(source: SourceFile) -> Iterator[tuple[int, object]]:
    """A plain .txt file: each run of non-blank lines is one document {"text": ...}, reported
    at its first line. Blank lines separate documents; they are not records."""
    lines: list[str] = []
    start = 0
    for number, raw in source.raw_lines():
        text = decode_line(source, number, raw)
        if isinstance(text, RecordIssue):
            yield number, text
            continue
        if text.strip():
            if not lines:
                start = number
            lines.append(text)
        elif lines:
            yield start, {"text": "\n".join(lines)}
            lines = []
    if lines:
        yield start, {"text": "\n".join(lines)}


def iter_file_records(source: SourceFile) -> Iterator[tuple[int, object]]:
    """Records of a local file: .txt as paragraphs, anything else as JSONL."""
    if source.path.suffix.lower() == ".txt":
        return iter_text_paragraphs(source)
    return iter_jsonl(source)
