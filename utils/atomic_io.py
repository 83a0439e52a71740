"""Atomic file writes: a reader (or a resumed run) sees the old file or the new one, never half.

The pattern is the classic one: write a temporary file in the destination's directory, fsync
it, `os.replace` it over the destination (atomic on POSIX within one filesystem), then fsync
the directory so the rename itself survives a power loss or a preempted VM.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a directory entry change (a rename, a new file) on filesystems that need it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that `path` is never seen partly written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600; give the file the mode a plain open() would (0666 less umask).
        os.fchmod(fd, 0o666 & ~_current_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # Includes KeyboardInterrupt: never leave the temporary behind.
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    """`atomic_write_bytes` for a JSON document (indented, UTF-8, trailing newline)."""
    text = json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))
