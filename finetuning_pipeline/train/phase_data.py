"""A phase's prepared data on one replica: the manifest, the resumable shard loader, the
batch arithmetic, and the batches on the device."""

from __future__ import annotations

from pathlib import Path

from dataset.loader import ShardLoader
from dataset.manifest import is_packed, read_manifest
from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.run.parallel import Parallel
from finetuning_pipeline.run_config import EvalConfig, TrainConfig


class PhaseData:
    """The phase's prepared data on this replica: its manifest, the resumable shard loader,
    and the batch arithmetic. Under fsdp a process reads the batches of all its chips; the
    global batch is the same sequence of blocks as dp over the same number of chips, and the
    cursor counts global blocks, so a run may resume on another number of chips as long as
    the global batch is the same."""

    def __init__(self, data_dir: str, *, train: TrainConfig, eval: EvalConfig, parallel: Parallel) -> None:
        """data_dir: the phase's prepared data; train: the batch shape and the data order's seed;
        eval: the evaluation batch."""
        t = train
        self.dir = data_dir
        self.manifest = read_manifest(self.dir)
        self.seq_len = self.manifest["seq_len"]
        self.packed = is_packed(self.manifest)
        self.pad_id = self.manifest["tokenizer"]["pad_id"]
        self.parallel = parallel
        self.loader = ShardLoader(self.dir, t.micro_batch * parallel.chips_per_process, seed=t.seed,
                                  rank=parallel.rank, world_size=parallel.world)
        self.eval_micro_batch = (eval.micro_batch or t.micro_batch) * parallel.chips_per_process
        self.batches_per_step = t.grad_accum * parallel.chips * t.micro_batch  # global blocks per step
        self.tokens_per_step = self.batches_per_step * self.seq_len
        self.chips_changed = None

    def resume(self, state: dict, resume_from: Path | None) -> int:
        """The first step to run; positions the loader at the global block it starts with."""
        start_step = state.get("step", 0)
        saved_batch = state.get("global_batch", self.batches_per_step)
        if saved_batch != self.batches_per_step:
            raise ConfigError(
                f"--resume: {resume_from} was saved with a global batch of {saved_batch} sequences, this run has "
                f"{self.batches_per_step} (train.micro_batch x train.grad_accum x {self.parallel.chips} chips); set "
                f"them so the product is {saved_batch}"
            )
        saved_chips = state.get("chips", self.parallel.chips)
        if saved_chips != self.parallel.chips:
            self.chips_changed = {"saved_on": saved_chips, "resumed_on": self.parallel.chips}
            if self.parallel.master:
                print(
                    f"note: {resume_from} was saved on {saved_chips} chips, resuming on {self.parallel.chips} with the "
                    f"same global batch of {saved_batch}: the data continues at global block "
                    f"{start_step * saved_batch}",
                    flush=True,
                )
        self.loader.position = start_step * self.batches_per_step
        return start_step

    def device_batches(self, device):
        """The phase's batches on the device, prefetched by torch_xla's loader thread. That thread
        drops an exception of the reader (a shard that became unreadable: EIO, a vanished
        network disk) and simply ends the iteration, which the loop would take for a
        StopIteration traceback; the reader's error is kept and raised here instead. Closing
        this generator stops and joins the loader's threads (they hold this PhaseData)."""
        import torch_xla.distributed.parallel_loader as pl

        failure: list[BaseException] = []

        def read():  # runs on the loader's thread
            try:
                yield from self.loader
            except Exception as err:
                failure.append(err)

        # We mark every step ourselves; by default the loader would also sync at each next().
        loader = pl.ParallelLoader(read(), [device], batches_per_execution=1 << 30,
                                   input_sharding=self.parallel.input_sharding())
        try:
            yield from loader.per_device_loader(device)
        finally:
            loader.close()
        raise failure[0] if failure else RuntimeError("the data loader stopped without an error (a bug)")
