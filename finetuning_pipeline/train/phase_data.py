"""A phase's prepared data on one replica: the manifest, the resumable shard loader, the
batch arithmetic, and the batches on the host (the runtime moves them to its device)."""

from __future__ import annotations

from pathlib import Path

import torch

from dataset.loader import ShardLoader
from dataset.manifest import is_packed, read_manifest
from dataset.shards import PREFERENCE
from finetuning_pipeline.distributed.parallel import Parallel
from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.run_config import EvalConfig, TrainConfig


class PhaseData:
    """The phase's prepared data on this replica: its manifest, the resumable shard loader,
    and the batch arithmetic. Under fsdp a process reads the batches of all its chips; the
    global batch is the same sequence of blocks as dp over the same number of chips, and the
    cursor counts global blocks, so a run may resume on another number of chips as long as
    the global batch is the same.

    Adapters side by side: a loader per adapter, each reading its data as a run of that
    adapter alone would (same seed, same order), and each micro-batch is their micro-batches
    one after another, in the adapters' order (the row groups of lora_logic/layer.py)."""

    def __init__(self, data_dirs: dict[str, str], *, train: TrainConfig, eval: EvalConfig,
                 parallel: Parallel, phase: int) -> None:
        """data_dirs: the phase's prepared data, {adapter: its dir}, in the adapters' order
        (RunConfig.data_dirs); train: the batch shape and the data order's seed; eval: the
        evaluation batch."""
        t = train
        self.dirs = dict(data_dirs)
        self.manifests = {name: read_manifest(d) for name, d in self.dirs.items()}
        lengths = {m["seq_len"] for m in self.manifests.values()}
        if len(lengths) > 1:
            raise ConfigError("adapters side by side share one batch shape, but their data is prepared at different "
                              "sequence lengths (" + ", ".join(f"{self.dirs[n]}: {m['seq_len']}"
                                                               for n, m in self.manifests.items())
                              + "); prepare them at one --seq-len")
        self.seq_len = lengths.pop()
        # Text rows take the position ids 0..L-1 they have, so a batch mixing text and chat is
        # run as packed (masks from position ids): the same result for the text rows.
        self.packed = any(is_packed(m) for m in self.manifests.values())
        self.preference = any(m.get("phase") == PREFERENCE for m in self.manifests.values())  # pairs (pair_rows)
        self.pad_id = next(iter(self.manifests.values()))["tokenizer"]["pad_id"]
        self.parallel = parallel
        self.loaders = {name: ShardLoader(d, t.micro_batch * parallel.chips_per_process, seed=t.seed,
                                          rank=parallel.rank, world_size=parallel.world)
                        for name, d in self.dirs.items()}
        self.eval_micro_batch = (eval.micro_batch or t.micro_batch) * parallel.chips_per_process
        self.micro_batch, self.grad_accum = t.micro_batch, t.grad_accum
        self.seed, self.phase = t.seed, phase
        self.batches_per_step = t.grad_accum * parallel.chips * t.micro_batch  # global blocks per step (per adapter)
        self.tokens_per_step = self.batches_per_step * self.seq_len * len(self.dirs)
        self.chips_changed = None
        self._check_global_batch()

    def _check_global_batch(self) -> None:
        """A step's global batch within each adapter's training blocks. The micro-batch alone is
        checked before any replica starts (run/input_checks.py); the devices multiplying it are
        known only here, and every replica computes the same refusal from the same config, so all
        stop at once, before their first step, saying the same line."""
        for name, manifest in self.manifests.items():
            blocks = manifest["counts"]["train"]
            if self.batches_per_step > blocks:
                product = (f"train.micro_batch {self.micro_batch} x train.grad_accum {self.grad_accum} x "
                           f"{self.parallel.chips} devices")
                raise ConfigError(
                    f"phase {self.phase}: a global batch of {self.batches_per_step} sequences a step ({product}) is "
                    f"more than the {blocks} training blocks of {self.dirs[name]}: every step would repeat blocks. "
                    f"Choose train.micro_batch x train.grad_accum x devices <= {blocks}, or prepare more data")

    def attach_reference_logps(self, values) -> None:
        """A preference phase's precomputed reference log-probabilities ([pairs, 2], in the pairs'
        order: reference_logps.py): each batch then carries its pairs' ("reference_logps")."""
        for loader in self.loaders.values():
            loader.arrays = {**loader.arrays, "reference_logps": values}

    def resume(self, state: dict, resume_from: Path | None) -> int:
        """The first step to run; positions the loader at the global block it starts with."""
        start_step = state.get("step", 0)
        saved_batch = state.get("global_batch", self.batches_per_step)
        if saved_batch != self.batches_per_step:
            raise ConfigError(
                f"--resume: {resume_from} was saved with a global batch of {saved_batch} sequences, this run has "
                f"{self.batches_per_step} (train.micro_batch {self.micro_batch} x train.grad_accum {self.grad_accum} "
                f"x {self.parallel.chips} devices); "
                + global_batch_advice(saved_batch, self.parallel.chips, self.micro_batch))
        saved_chips = state.get("chips", self.parallel.chips)
        if saved_chips != self.parallel.chips:
            self.chips_changed = {"saved_on": saved_chips, "resumed_on": self.parallel.chips}
            if self.parallel.master:
                print(
                    f"note: {resume_from} was saved on {saved_chips} devices, resuming on {self.parallel.chips} with "
                    f"the same global batch of {saved_batch}: the data continues at global block "
                    f"{start_step * saved_batch}",
                    flush=True,
                )
        for loader in self.loaders.values():
            loader.position = start_step * self.batches_per_step
        return start_step

    def batches(self):
        """The replica's micro-batches on the host: each adapter's rows one after another, each row
        with the seed of its LoRA dropout masks ("lora_seed", lora_dropout_seeds). A batch of pairs
        (preference data) is run as its chosen rows, then its rejected rows: a seed for each."""
        for parts in zip(*self.loaders.values()):
            batch = parts[0] if len(parts) == 1 else {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
            seeds = lora_dropout_seeds(batch.pop("stream_position"), self.seed, self.phase)
            if self.preference:  # each adapter's chosen rows, then its rejected rows (preference_loss.pair_rows)
                seeds = torch.cat([rows for part in seeds.chunk(len(parts))
                                   for rows in (part, part ^ REJECTED_ROW_SALT)])
            yield {**batch, "lora_seed": seeds}


# A pair's rejected row draws other LoRA dropout masks than its chosen row (an odd constant: any
# seed maps to another, and no pair's rejected seed is a chosen seed of the pairs near it).
REJECTED_ROW_SALT = 0x2545F491


def lora_dropout_seeds(positions: torch.Tensor, seed: int, phase: int) -> torch.Tensor:
    """The seeds of a batch's LoRA dropout masks (lora_logic/dropout.py): int32 [rows, 1], each
    sequence's from its place in the global stream of blocks (dataset/loader.py's "stream_position")
    and the phase's key (train.seed, phase). A sequence then draws the same masks whichever replica
    and micro-batch hold it: 1, 2 or 4 processes, dp or fsdp, any micro-batch and accumulation, and
    a resume on another count train one run; a sequence side by side draws its adapter-alone run's."""
    key = ((seed * 3 + phase) * 1_000_003 + 7) % (2**31 - 1)
    return positions.to(torch.int32) ^ key


def global_batch_advice(saved_batch: int, devices: int, micro_batch: int) -> str:
    """How a run on `devices` devices (chips, or processes each with its own) gets a checkpoint's
    global batch back: train.micro_batch x train.grad_accum x devices must equal it, which needs
    `devices` to divide it."""
    if saved_batch % devices:
        counts = ", ".join(str(n) for n in range(1, saved_batch + 1) if saved_batch % n == 0)
        return (f"{saved_batch} is not a multiple of {devices} devices: resume on a number of devices that divides "
                f"it ({counts})")
    per_device = saved_batch // devices
    fitting = max(n for n in range(1, min(micro_batch, per_device) + 1) if per_device % n == 0)
    return (f"set train.micro_batch x train.grad_accum to {per_device} on {devices} devices (e.g. "
            f"train.micro_batch={fitting} train.grad_accum={per_device // fitting})")
