"""Fixed-shape shards on disk: int32 [N, seq_len] `.npy` files, written streaming, read mmap'd.

A split directory (`train/`, `eval/`) holds input_ids.npy, labels.npy and position_ids.npy,
all [N, seq_len] int32, row i of each describing the same block; a split of preference pairs
holds chosen_input_ids.npy, chosen_labels.npy, rejected_input_ids.npy and rejected_labels.npy,
row i of each the same pair (dataset/preference.py). They are standard `.npy`
files (`np.load(path, mmap_mode="r")` reads them). N is unknown until the input ends, so the
writer reserves a fixed-size header, streams the rows, and patches N into the header last.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dataset.errors import DataError

ARRAYS = ("input_ids", "labels", "position_ids")
PREFERENCE_ARRAYS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
PREFERENCE = "preference"  # the manifest's "phase" of preference pairs (1 and 2: the masking of text)


def arrays_of(phase) -> tuple[str, ...]:
    """The arrays of a split of data prepared for `phase` (the manifest's)."""
    return PREFERENCE_ARRAYS if phase == PREFERENCE else ARRAYS
HEADER_BYTES = 128  # multiple of 64, as the .npy format asks; room for any realistic N


def npy_header(rows: int, seq_len: int) -> bytes:
    """A version-1.0 .npy header for int32 [rows, seq_len], padded to HEADER_BYTES."""
    text = f"{{'descr': '<i4', 'fortran_order': False, 'shape': ({rows}, {seq_len}), }}"
    prefix = b"\x93NUMPY\x01\x00"
    body_len = HEADER_BYTES - len(prefix) - 2
    body = text.ljust(body_len - 1) + "\n"
    return prefix + len(body).to_bytes(2, "little") + body.encode("latin1")


class NpyRowWriter:
    """Append int32 rows of length seq_len to a .npy file; `close()` writes the final shape."""

    def __init__(self, path: str | Path, seq_len: int) -> None:
        self.path = Path(path)
        self.seq_len = seq_len
        self.rows = 0
        self.file = open(self.path, "wb")
        self.file.write(npy_header(0, seq_len))

    def write(self, row: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(row, dtype="<i4").tobytes())
        self.rows += 1

    def close(self) -> None:
        self.file.seek(0)
        self.file.write(npy_header(self.rows, self.seq_len))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


class SplitWriter:
    """The arrays of one split (`names`), written row by row together."""

    def __init__(self, directory: str | Path, seq_len: int, names: tuple[str, ...] = ARRAYS) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.writers = [NpyRowWriter(self.directory / f"{name}.npy", seq_len) for name in names]
        self.labels = [index for index, name in enumerate(names) if name.endswith("labels")]
        self.rows = 0
        self.tokens = 0  # non-pad tokens (position of real content), for the fill ratio
        self.label_tokens = 0

    def write(self, block: tuple[np.ndarray, np.ndarray, np.ndarray], real_tokens: int) -> None:
        for writer, array in zip(self.writers, block, strict=True):
            writer.write(array)
        self.rows += 1
        self.tokens += real_tokens
        self.label_tokens += sum(int((block[index] != -100).sum()) for index in self.labels)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def open_split(directory: str | Path, shape: tuple[int, int] | None = None,
               names: tuple[str, ...] = ARRAYS) -> dict[str, np.ndarray]:
    """The memory-mapped arrays (`names`) of a split directory, checked for matching shapes, and
    against `shape` (blocks, seq_len: what the manifest says) when given. A missing, truncated or
    misshapen file is a DataError naming it: prepared data copied half-way, or edited."""
    directory = Path(directory)
    again = "prepare it again (python -m dataset.prepare), or copy the whole directory again"
    arrays = {}
    for name in names:
        path = directory / f"{name}.npy"
        if not path.is_file():
            raise DataError(f"{path}: missing, so the prepared data is incomplete; {again}")
        try:
            arrays[name] = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as err:  # "mmap length is greater than file size": cut short
            raise DataError(f"{path}: truncated or unreadable ({err}); {again}") from None
    shapes = {name: a.shape for name, a in arrays.items()}
    first = arrays[names[0]]
    if len(set(shapes.values())) != 1 or first.ndim != 2:
        raise DataError(f"{directory}: arrays disagree in shape {shapes}; {again}")
    if shape is not None and tuple(first.shape) != tuple(shape):
        raise DataError(f"{directory}: {first.shape[0]} blocks of {first.shape[1]} tokens, "
                        f"its manifest says {shape[0]} of {shape[1]}; {again}")
    return arrays
