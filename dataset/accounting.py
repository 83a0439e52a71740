"""Every input record is accounted for: read = kept + skipped, with a reason for each skip."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class FileCounts:
    path: str
    read: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"path": self.path, "read": self.read, "kept": self.kept, "skipped": dict(sorted(self.skipped.items()))}


class RecordAccounts:
    """Counts per file and per reason. `read` is counted when a record is seen; `keep` or
    `skip` exactly once when its fate is decided (possibly later, after tokenization)."""

    def __init__(self) -> None:
        self.files: list[FileCounts] = []
        self.truncated = 0
        self.empty_files: list[str] = []

    def add_file(self, path: str) -> int:
        self.files.append(FileCounts(path))
        return len(self.files) - 1

    def read(self, file_index: int) -> None:
        self.files[file_index].read += 1

    def keep(self, file_index: int) -> None:
        self.files[file_index].kept += 1

    def skip(self, file_index: int, reason: str) -> None:
        self.files[file_index].skipped[reason] += 1

    @property
    def total_read(self) -> int:
        return sum(f.read for f in self.files)

    @property
    def total_kept(self) -> int:
        return sum(f.kept for f in self.files)

    def skipped_by_reason(self) -> dict[str, int]:
        total = Counter()
        for f in self.files:
            total += f.skipped
        return dict(sorted(total.items()))

    def check_balanced(self) -> None:
        """read == kept + skipped for every file; a mismatch is a bug in prepare, not in the data."""
        for f in self.files:
            if f.read != f.kept + sum(f.skipped.values()):
                raise AssertionError(f"record accounting broke for {f.path}: {f.as_dict()}")

    def as_dict(self) -> dict:
        skipped = self.skipped_by_reason()
        return {
            "read": self.total_read,
            "kept": self.total_kept,
            "skipped": sum(skipped.values()),
            "skipped_by_reason": skipped,
            "truncated": self.truncated,
            "empty_files": self.empty_files,
            "files": [f.as_dict() for f in self.files],
        }
