"""A file's sha256, read in blocks: checkpoints' integrity, resume keys, adapters' lineage."""

from __future__ import annotations

import hashlib
import os


def sha256_file(path: str | os.PathLike) -> str:
    """The hex sha256 of the file at `path` (read 1 MiB at a time: an adapter or shard of any size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
