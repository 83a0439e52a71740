"""How bad input is reported: every problem names its file and line, and has a reason code.

`RecordIssue` is one skipped (or, in strict mode, fatal) record; `DataError` is what the
`prepare` command turns into an exit status of 2 and a message without a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass


class DataError(Exception):
    """A problem with the user's data or data options; the message says where and what to do."""


@dataclass(frozen=True)
class RecordIssue:
    """One input record that cannot be used.

    reason: a short stable code counted in stats.json (e.g. "malformed_json").
    detail: the human explanation printed after FILE:LINE.
    """

    path: str
    line: int
    reason: str
    detail: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.detail}"


class InvalidRecord(Exception):
    """Raised by format validation; carries the reason code and the explanation."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
