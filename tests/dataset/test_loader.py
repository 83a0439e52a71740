"""The shard loader: fixed shapes, disjoint and complete replica slices, exact resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dataset import prepare
from dataset.errors import DataError
from dataset.loader import ShardLoader, iter_eval_batches, open_prepared
from dataset.manifest import tokenizer_fingerprint
from dataset.samples import CHAT_QA
from dataset.shards import ARRAYS


@pytest.fixture(scope="module")
def prepared(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "chat"
    args = [
        "--input",
        str(CHAT_QA),
        "--tokenizer",
        str(tiny_model_dir),
        "--seq-len",
        "64",
        "--out",
        str(out),
        "--quiet",
    ]
    assert prepare.main(args) == 0
    return out


def test_batches_have_one_shape_and_cross_epochs(prepared):
    loader = ShardLoader(prepared, micro_batch=5, seed=0)
    rows = loader.rows
    for step in range(2 * rows // 5 + 1):  # more than two epochs
        batch = loader.next_batch()
        positions = batch.pop("stream_position")  # where each block stands in the global stream
        assert {k: tuple(v.shape) for k, v in batch.items()} == {k: (5, 64) for k in ARRAYS}
        assert positions.dtype == torch.int32 and positions.reshape(-1).tolist() == list(range(5 * step, 5 * step + 5))
    assert loader.epoch > 2


def global_stream(directory, world_size, micro_batch, steps, seed=0):
    """Rebuild the global order from what each replica was given."""
    loaders = [ShardLoader(directory, micro_batch, seed=seed, rank=r, world_size=world_size) for r in range(world_size)]
    stream = np.empty(steps * world_size * micro_batch, dtype=np.int64)
    for step in range(steps):
        for rank, loader in enumerate(loaders):
            base = step * world_size * micro_batch
            stream[base + rank + world_size * np.arange(micro_batch)] = loader.next_indices()
    return stream, loaders[0].rows


@pytest.mark.parametrize("world_size, micro_batch", [(1, 4), (3, 2), (4, 5)])
def test_replica_slices_are_disjoint_and_complete_every_epoch(prepared, world_size, micro_batch):
    rows = ShardLoader(prepared, 1).rows
    steps = -(-3 * rows // (world_size * micro_batch))
    stream, rows = global_stream(prepared, world_size, micro_batch, steps)
    for epoch in range(3):
        assert sorted(stream[epoch * rows : (epoch + 1) * rows]) == list(range(rows))
    assert not np.array_equal(stream[:rows], stream[rows : 2 * rows])  # reshuffled per epoch


def test_the_order_does_not_depend_on_world_size(prepared):
    single, _ = global_stream(prepared, 1, 6, 10)
    quad, _ = global_stream(prepared, 4, 3, 5)
    assert np.array_equal(single[:60], quad[:60])


def test_resume_after_a_real_save_gives_the_same_batches(prepared, tmp_path):
    reference = ShardLoader(prepared, micro_batch=3, seed=7, rank=1, world_size=2)
    expected = [reference.next_batch() for _ in range(25)]

    first = ShardLoader(prepared, micro_batch=3, seed=7, rank=1, world_size=2)
    for _ in range(11):
        first.next_batch()
    (tmp_path / "loader.json").write_text(json.dumps(first.state_dict()))

    resumed = ShardLoader(prepared, micro_batch=3, seed=7, rank=1, world_size=2)
    resumed.load_state_dict(json.loads((tmp_path / "loader.json").read_text()))
    for want in expected[11:]:
        got = resumed.next_batch()
        assert all(np.array_equal(got[k].numpy(), want[k].numpy()) for k in want)


def test_resume_with_another_seed_is_refused(prepared):
    state = ShardLoader(prepared, 2, seed=1).state_dict()
    with pytest.raises(DataError, match="seed=1 but this loader has seed=2"):
        ShardLoader(prepared, 2, seed=2).load_state_dict(state)


def test_eval_batches_cover_every_block_once_with_masked_filler(prepared):
    manifest = open_prepared(prepared)
    rows = manifest["counts"]["eval"]
    eval_ids = np.load(prepared / "eval" / "input_ids.npy")
    seen = []
    counts = []
    for rank in range(3):
        batches = list(iter_eval_batches(prepared, 2, pad_id=3, rank=rank, world_size=3))
        counts.append(len(batches))
        for batch in batches:
            for ids, labels in zip(batch["input_ids"].numpy(), batch["labels"].numpy()):
                if (labels != -100).any():
                    seen.append(ids.tobytes())
                else:
                    assert np.all(ids == 3)
    assert len(set(counts)) == 1  # every replica runs the same number of eval steps
    assert sorted(seen) == sorted(row.tobytes() for row in eval_ids) and len(seen) == rows


def test_manifest_mismatch_names_both_values(prepared, tiny_model_dir):
    from transformers import AutoTokenizer

    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_model_dir))
    assert open_prepared(prepared, fingerprint=fingerprint, seq_len=64)["seq_len"] == 64
    with pytest.raises(DataError, match="packed for seq_len 64, but the run uses seq_len 128"):
        open_prepared(prepared, fingerprint=fingerprint, seq_len=128)
    with pytest.raises(
        DataError, match=f"tokenized by tokenizer {fingerprint}, but the run's tokenizer is sha256:other"
    ):
        open_prepared(prepared, fingerprint="sha256:other", seq_len=64)


@pytest.mark.parametrize("damage, message", [
    ("truncate", r"train/input_ids\.npy: truncated or unreadable \(mmap length is greater than file size\)"),
    ("remove", r"train/labels\.npy: missing, so the prepared data is incomplete"),
    ("fewer blocks", r"train: \d+ blocks of 64 tokens, its manifest says \d+ of 64"),
])
def test_damaged_shards_are_named_where_the_data_is_opened(prepared, tmp_path, damage, message):
    """A truncated or missing shard is checked against the manifest when the data is opened,
    before any training, as a DataError (exit 2) naming the file: not a numpy traceback in
    main.py and evaluate, a pass in preflight, or exit 3 ("fix the disk")."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    ids = copy / "train" / "input_ids.npy"
    if damage == "truncate":
        ids.write_bytes(ids.read_bytes()[:-100])
    elif damage == "remove":
        (copy / "train" / "labels.npy").unlink()
    else:
        for name in ("input_ids", "labels", "position_ids"):
            path = copy / "train" / f"{name}.npy"
            np.save(path, np.load(path)[:-1])
    with pytest.raises(DataError, match=message):
        open_prepared(copy)
    with pytest.raises(DataError, match=message):
        ShardLoader(copy, micro_batch=2)
