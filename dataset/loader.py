"""Stream fixed-shape batches from prepared shards to one replica, resumably.

Training order: the global stream is epoch 0's permutation of the N blocks, then epoch 1's,
and so on, each drawn from (seed, epoch). Replica r of W takes global positions
r, r + W, r + 2W, ... so the replicas' slices are disjoint, together they use every block
exactly once per epoch, and an epoch boundary may fall inside a batch (no block is dropped
or repeated to make shapes fit). The whole cursor is one integer, `position`: the number of
global blocks consumed, equal on every replica, so a resumed run sees exactly the batches it
would have seen.

Batches are dicts of CPU int32 tensors [micro_batch, seq_len] ("input_ids", "labels",
"position_ids"); int32 halves the host-to-device bytes, the trainer widens on device. A training
batch also says where each of its blocks stands in the global stream ("stream_position", int32
[micro_batch, 1], modulo 2**31): what the trainer keys a sequence's LoRA dropout masks to, so that
they do not depend on which replica or micro-batch holds it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from dataset.encode import IGNORE_INDEX
from dataset.errors import DataError
from dataset.manifest import check_manifest, read_manifest
from dataset.shards import arrays_of, open_split


def open_prepared(directory: str | Path, *, fingerprint: str | None = None, seq_len: int | None = None,
                  setting: str = "the run's seq_len", new_tokens: list[str] | None = None) -> dict:
    """The manifest of a prepared dataset, checked against the run's tokenizer and, when given,
    seq_len (`setting` names where that seq_len is configured), and its shards against the
    manifest (every file there, of the blocks it counts), before any training starts."""
    manifest = read_manifest(directory)
    for split in manifest.get("counts", {}):
        open_shards(directory, split, manifest)
    if fingerprint is not None:
        check_manifest(
            manifest,
            fingerprint=fingerprint,
            seq_len=manifest.get("seq_len") if seq_len is None else seq_len,
            source=str(Path(directory) / "manifest.json"),
            setting=setting,
            new_tokens=new_tokens,
        )
    return manifest


def open_shards(directory: str | Path, split: str, manifest: dict | None = None) -> dict[str, np.ndarray]:
    """The memory-mapped arrays of one split of a prepared dataset, checked against its manifest."""
    manifest = read_manifest(directory) if manifest is None else manifest
    blocks = manifest.get("counts", {}).get(split)
    return open_split(Path(directory) / split, None if blocks is None else (blocks, manifest.get("seq_len")),
                      arrays_of(manifest.get("phase")))


class ShardLoader:
    """An endless, deterministic, resumable stream of training batches for one replica."""

    def __init__(
        self,
        directory: str | Path,
        micro_batch: int,
        *,
        split: str = "train",
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.arrays = open_shards(directory, split)
        self.rows = next(iter(self.arrays.values())).shape[0]
        if self.rows == 0:
            raise DataError(f"{Path(directory) / split}: no blocks; prepare more data or lower --seq-len")
        self.micro_batch = micro_batch
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.position = 0
        self._orders: dict[int, np.ndarray] = {}

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of block indices for `epoch` (the same on every replica)."""
        if epoch not in self._orders:
            if len(self._orders) > 2:  # a batch spans at most two epochs
                self._orders.pop(min(self._orders))
            if self.shuffle:
                self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.rows)
            else:
                self._orders[epoch] = np.arange(self.rows)
        return self._orders[epoch]

    @property
    def epoch(self) -> float:
        """Epochs completed, fractional (for logging)."""
        return self.position / self.rows

    def next_positions(self) -> np.ndarray:
        """The global stream positions of this replica's next batch (not advancing the cursor)."""
        return self.position + self.rank + self.world_size * np.arange(self.micro_batch)

    def next_indices(self) -> np.ndarray:
        """Block indices of this replica's next batch; advances the shared cursor by one global batch."""
        positions = self.next_positions()
        epochs, offsets = np.divmod(positions, self.rows)
        indices = np.empty(self.micro_batch, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            indices[mask] = self.epoch_order(int(epoch))[offsets[mask]]
        self.position += self.world_size * self.micro_batch
        return indices

    def next_batch(self) -> dict[str, torch.Tensor]:
        positions = self.next_positions() % 2**31
        indices = self.next_indices()
        batch = {name: torch.from_numpy(np.asarray(array[indices])) for name, array in self.arrays.items()}
        return {**batch, "stream_position": torch.from_numpy(positions.astype(np.int32).reshape(-1, 1))}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {"position": self.position, "rows": self.rows, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        for key in ("rows", "seed", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise DataError(
                    f"loader state was saved with {key}={state.get(key)!r} but this loader has "
                    f"{key}={getattr(self, key)!r}; "
                    "resume with the same prepared data and seed"
                )
        self.position = int(state["position"])


def filler_row(name: str, seq_len: int, pad_id: int) -> np.ndarray:
    """A padding row of array `name` (labels: nothing to train; positions: 0..L-1; ids: pad)."""
    if name.endswith("labels"):
        return np.full(seq_len, IGNORE_INDEX, dtype=np.int32)
    if name == "position_ids":
        return np.arange(seq_len, dtype=np.int32)
    return np.full(seq_len, pad_id, dtype=np.int32)


def iter_eval_batches(
    directory: str | Path, micro_batch: int, *, pad_id: int, rank: int = 0, world_size: int = 1, split: str = "eval"
) -> Iterator[dict[str, torch.Tensor]]:
    """Every eval block exactly once across replicas, in order, in fixed-shape batches.

    Replica r gets blocks r, r + W, ...; the last batches are filled with padding rows whose
    labels are all -100, so they add nothing to the loss (nor, preference pairs, to the pairs:
    model/preference_loss.py), and every replica yields the same number of batches (replicas must
    agree on the number of steps).
    """
    arrays = open_shards(directory, split)
    rows, seq_len = next(iter(arrays.values())).shape
    mine = np.arange(rank, rows, world_size)
    per_replica = -(-rows // world_size)
    batches = -(-per_replica // micro_batch)
    filler = {name: filler_row(name, seq_len, pad_id) for name in arrays}
    for b in range(batches):
        indices = mine[b * micro_batch : (b + 1) * micro_batch]
        batch = {}
        for name in arrays:
            data = np.asarray(arrays[name][indices])
            missing = micro_batch - len(indices)
            if missing:
                data = np.concatenate([data, np.tile(filler[name], (missing, 1))])
            batch[name] = torch.from_numpy(np.ascontiguousarray(data, dtype=np.int32))
        yield batch
