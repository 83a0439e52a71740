"""Pack variable-length samples into fixed [seq_len] blocks, so the TPU only ever sees one shape.

A block is three int32 arrays of length seq_len: input_ids, labels, position_ids. Packers
yield (block, real_tokens), real_tokens being the non-padding count (for the fill ratio).

Phase 1 (`StreamPacker`): documents are concatenated and cut every seq_len tokens (the
usual causal-LM recipe); a document may span blocks, positions run 0..seq_len-1. The last,
partial block is padded rather than dropped, so every token is kept.

Phase 2 (`BestFitPacker`): each conversation goes whole into the open block with the least
room that still fits it (best fit); `position_ids` restart at 0 for each conversation, so
segment starts are where position_ids == 0. At most `max_open` blocks are open at a time
(the fullest is emitted when more are needed), which bounds memory on any input size.
Padding carries the pad id, label -100, and positions counting from 0 (its own segment).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from dataset.encode import IGNORE_INDEX

Block = tuple[np.ndarray, np.ndarray, np.ndarray]  # (input_ids, labels, position_ids), each [seq_len]


class StreamPacker:
    """Concatenate documents and cut them into seq_len blocks (phase 1)."""

    def __init__(self, seq_len: int, pad_id: int) -> None:
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.buffer: list[int] = []
        self.positions = np.arange(seq_len, dtype=np.int32)

    def add(self, ids: list[int]) -> Iterator[tuple[Block, int]]:
        self.buffer.extend(ids)
        if len(self.buffer) < self.seq_len:
            return
        full = len(self.buffer) // self.seq_len * self.seq_len
        rows = np.asarray(self.buffer[:full], dtype=np.int32).reshape(-1, self.seq_len)
        del self.buffer[:full]
        for row in rows:
            yield (row, row.copy(), self.positions), self.seq_len

    def flush(self) -> Iterator[tuple[Block, int]]:
        if not self.buffer:
            return
        n = len(self.buffer)
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int32)
        ids[:n] = self.buffer
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int32)
        labels[:n] = self.buffer
        self.buffer = []
        yield (ids, labels, self.positions), n


@dataclass
class _OpenBlock:
    ids: list[np.ndarray] = field(default_factory=list)
    labels: list[np.ndarray] = field(default_factory=list)
    used: int = 0


class BestFitPacker:
    """Best-fit packing of whole conversations (phase 2)."""

    def __init__(self, seq_len: int, pad_id: int, max_open: int = 64) -> None:
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.max_open = max_open
        self.open: dict[int, _OpenBlock] = {}
        self.by_room: list[tuple[int, int]] = []  # sorted (room left, block id)
        self.next_id = 0

    def add(self, ids: np.ndarray, labels: np.ndarray) -> Iterator[tuple[Block, int]]:
        n = len(ids)
        if n > self.seq_len:
            raise ValueError(f"sample of {n} tokens is longer than seq_len {self.seq_len}; truncate or drop it first")
        slot = bisect.bisect_left(self.by_room, (n, -1))
        if slot < len(self.by_room):
            room, block_id = self.by_room.pop(slot)
        else:
            if len(self.open) >= self.max_open:
                yield self._emit(self.by_room.pop(0)[1])  # the fullest open block
            room, block_id = self.seq_len, self.next_id
            self.open[block_id] = _OpenBlock()
            self.next_id += 1
        block = self.open[block_id]
        block.ids.append(ids)
        block.labels.append(labels)
        block.used += n
        room -= n
        if room == 0:
            yield self._emit(block_id)
        else:
            bisect.insort(self.by_room, (room, block_id))

    def flush(self) -> Iterator[tuple[Block, int]]:
        # Oldest first, so the output order does not depend on how full the blocks are.
        for block_id in sorted(self.open):
            yield self._emit(block_id)
        self.by_room = []

    def _emit(self, block_id: int) -> tuple[Block, int]:
        block = self.open.pop(block_id)
        pad = self.seq_len - block.used
        ids = np.concatenate(block.ids + [np.full(pad, self.pad_id, dtype=np.int32)])
        labels = np.concatenate(block.labels + [np.full(pad, IGNORE_INDEX, dtype=np.int32)])
        positions = np.concatenate(
            [np.arange(len(x), dtype=np.int32) for x in block.ids] + [np.arange(pad, dtype=np.int32)]
        )
        return (ids, labels, positions), block.used
