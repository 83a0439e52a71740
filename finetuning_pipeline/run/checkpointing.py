"""Checkpoints: written atomically, marked complete last, never resumed from half-written.

A checkpoint is `phaseN/checkpoints/step_XXXXXXXX/` with
  adapter_config.json, adapter_model.safetensors   the LoRA weights (a loadable PEFT adapter)
  adapters/<name>/                                 instead, adapters trained side by side: one each
  optimizer.pt                                     AdamW state, on CPU (moments per LoRA weight, layers unscanned)
  trainer_state.json                               step, loader position, phase, config hash
  rng.pt                                           python, numpy and torch RNG states (XLA: seeded per step)
  COMPLETE                                         written last: {"step", "files": {relative path: sha256}}
Its files are written in its final directory and fsynced, and the COMPLETE marker, which lists
them with their sha256, last: a checkpoint is complete when its marker is there and the files
match it, whatever the file system did with a crash, so no directory is ever renamed (gcsfuse
cannot rename a directory on a flat-namespace bucket, the kind most pods' output_dir is). A crash
at any moment leaves a directory without a marker, never one that looks complete; leftovers of an
interrupted save (directories without COMPLETE, and the hidden temporaries of earlier versions)
are removed on the next start.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from dataset.manifest import content_digest, read_manifest
from finetuning_pipeline.errors import CheckpointWriteError
from finetuning_pipeline.model.lineage import base_fingerprint
from finetuning_pipeline.run.run_layout import RunLayout, adapter_dirs
from lora_logic.adapter_io import load_adapters, save_adapters
from lora_logic.adapters import adapter_names, per_layer_lora, per_layer_lora_names, stacked_lora
from lora_logic.config import LoraConfig, adapter_set
from utils.atomic_io import fsync_dir
from utils.file_digest import sha256_file

COMPLETE = "COMPLETE"
PREFIX = "step_"
SIDE_BY_SIDE_DIR = "adapters"


def checkpoint_adapters(path: Path, names: list[str]) -> dict[str, Path]:
    """Where a checkpoint holds each adapter: one in the checkpoint itself (a loadable PEFT
    adapter), adapters side by side in `adapters/<name>/` each."""
    return adapter_dirs(names, path, path / SIDE_BY_SIDE_DIR)


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and is_complete(p)]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def clean_partial_checkpoints(root: str | Path) -> list[str]:
    """Remove what an interrupted save left behind; returns the names removed."""
    root = Path(root)
    removed = []
    if not root.is_dir():
        return removed
    for path in root.iterdir():
        if path.is_dir() and (path.name.startswith(".") or (path.name.startswith(PREFIX) and not is_complete(path))):
            shutil.rmtree(path)
            removed.append(path.name)
    return removed


def to_cpu(obj):
    """A copy of a (nested) state with every tensor moved to contiguous CPU memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu").contiguous()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def rng_state() -> dict:
    """The host RNGs. The XLA RNG is not saved: the trainer seeds it from the step number at
    every step (trainer.step_seed), which is what makes dropout resume exactly."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng_state(state: dict) -> None:
    """(Checkpoints written before the per-step seed also hold an "xla" entry: ignored.)"""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(root: str | Path, step: int, *, model, optimizer,
                    lora_config: LoraConfig | dict[str, LoraConfig], base_model: str, trainer_state: dict,
                    keep: int) -> Path:
    """Write checkpoint `step` under `root` (master only; call `torch_xla.sync()` first).
    lora_config: the model's set of adapters, {name: config} (a LoraConfig alone: its one adapter)."""
    lora_config = adapter_set(lora_config)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    if final.exists():  # the same step again (a resume from an older checkpoint): unmarked before it is rewritten
        (final / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(final)
    final.mkdir()
    try:
        save_adapters(model, checkpoint_adapters(final, list(lora_config)), lora_config, base_model)
        torch.save(to_cpu(optimizer_state_by_name(model, optimizer)), final / "optimizer.pt")
        torch.save(rng_state(), final / "rng.pt")
        (final / "trainer_state.json").write_text(json.dumps({**trainer_state, "step": step}, indent=2) + "\n")
        files = {p.relative_to(final).as_posix(): sha256_file(p) for p in sorted(final.rglob("*")) if p.is_file()}
        for name in files:
            with open(final / name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(final)
        marker = final / COMPLETE  # last: the checkpoint is complete from here on
        marker.write_text(json.dumps({"step": step, "files": files}, indent=2) + "\n")
        with open(marker, "rb") as f:
            os.fsync(f.fileno())
        fsync_dir(final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(final, ignore_errors=True)
        raise
    prune_checkpoints(root, keep)
    return final


def data_content_key(config, phase: int, adapter: str) -> str:
    """The resume key of the prepared data of one of a phase's adapters (RunConfig.data_key's)."""
    return f"{config.data_key(phase, adapter)}.content"


BASE_WEIGHTS_KEY = "model.weights"


def resume_keys(config, phase: int, manifests: dict | None = None) -> dict:
    """The phase's resume keys, what a checkpoint (trainer_state.json) and the summary record to
    refuse a resume that would not continue the same run: the settings that decide the result
    (RunConfig.resume_keys), a local base's weights (lineage.base_fingerprint), the content of the phase's
    prepared data (re-preparing into the same directory between a stop and its resume would
    otherwise silently continue on another stream; `phaseN.adapters.<name>.data.content` for
    each adapter side by side), and the digest of each earlier phase's adapter it is built on
    (RunConfig.lineage: an earlier phase trained again makes this phase another run).
    manifests: the phase's, if already read ({adapter: manifest}, as PhaseData.manifests)."""
    keys = config.resume_keys(phase)
    if Path(config.model.path).is_dir():  # a local base is known by its weights, as lineage.json knows it
        keys[BASE_WEIGHTS_KEY] = base_fingerprint(config.model.path)
    for name, data in config.data_dirs(phase).items():
        manifest = manifests[name] if manifests is not None else read_manifest(data)
        keys[data_content_key(config, phase, name)] = content_digest(manifest)
    merged, continued = config.lineage(phase)
    layout = RunLayout(config.output_dir)
    for earlier in merged + ([continued] if continued else []):
        weights = layout.adapter(earlier) / "adapter_model.safetensors"
        keys[f"phase{earlier}.adapter"] = sha256_file(weights) if weights.is_file() else None
    return keys


def changed_resume_keys(saved: dict, current: dict) -> list[str]:
    """The resume keys both record and that differ. A local base's path is not compared where both
    record its weights (BASE_WEIGHTS_KEY): a base that moved, or is reached through another path,
    is the same base; other weights at the same path are another one."""
    common = set(saved) & set(current)
    if BASE_WEIGHTS_KEY in common:
        common.discard("model.path")
    return sorted(k for k in common if saved[k] != current[k])


def saved_resume_keys(record: dict) -> dict:
    """The resume keys a trainer_state.json or summary.json holds (written before they had one
    name: "exactness" in a checkpoint, "settings" in a summary)."""
    return record.get("resume_keys") or record.get("exactness") or record.get("settings") or {}


def prune_checkpoints(root: Path, keep: int) -> None:
    """Keep the `keep` newest complete checkpoints (never fewer than one)."""
    for old in complete_checkpoints(root)[: -max(1, keep)]:
        shutil.rmtree(old)


def verify_checkpoint(path: Path) -> dict:
    """The COMPLETE marker's content, after checking every listed file's sha256 and that
    trainer_state.json reads; a problem is a ValueError naming the file."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint directory")
    if not is_complete(path):
        if any((path / name).exists() for name in ("trainer_state.json", "optimizer.pt", "rng.pt")):
            raise ValueError(f"{path}: incomplete checkpoint (no {COMPLETE} marker); it was interrupted while saving")
        where = "a checkpoint is a directory OUTPUT_DIR/phaseN/checkpoints/step_NNNNNNNN"
        if (path / "adapter_config.json").is_file():
            raise ValueError(f"{path}: an adapter, not a checkpoint ({where}; an adapter holds no optimizer state or "
                             "data position to resume from)")
        raise ValueError(f"{path}: not a checkpoint ({where})")
    marker = read_json(path / COMPLETE)
    if not isinstance(marker.get("files"), dict) or "trainer_state.json" not in marker["files"]:
        raise ValueError(f"{path / COMPLETE}: not a checkpoint marker (no file list with trainer_state.json)")
    for name, digest in marker["files"].items():
        if not (path / name).is_file() or sha256_file(path / name) != digest:
            raise ValueError(f"{path / name}: missing or corrupt (sha256 differs from the {COMPLETE} marker)")
    read_json(path / "trainer_state.json")
    return marker


def checkpoint_step(checkpoint: Path | None) -> int:
    """The step a complete checkpoint was saved at; 0 for none (a phase that starts fresh)."""
    return read_json(checkpoint / "trainer_state.json")["step"] if checkpoint else 0


def read_json(path: Path) -> dict:
    """A JSON object from `path`; a truncated or garbled file is a ValueError naming it."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: unreadable ({err}); the file is truncated or corrupt") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object; the file is corrupt")
    return value


def newest_intact_checkpoint(root: str | Path, report=print) -> Path | None:
    """The newest complete checkpoint under `root` whose files verify. Each newer one that
    does not (a flipped byte, a truncated file) is skipped and `report`ed with the reason;
    when every one fails, a ValueError lists them: a silent fresh start would lose the run."""
    failures = []
    for path in reversed(complete_checkpoints(root)):
        try:
            verify_checkpoint(path)
        except (ValueError, OSError) as err:
            failures.append(str(err))
            report(f"warning: skipping checkpoint {path.name}: {err}")
            continue
        return path
    if failures:
        raise ValueError(f"no intact checkpoint under {root} ({'; '.join(failures)})")
    return None


def load_checkpoint(path: str | Path, *, model) -> dict:
    """Restore the LoRA weights and RNG states from a complete checkpoint into a model whose
    layers are not scanned yet (load_optimizer_state follows once the optimizer exists);
    returns the trainer state (step, loader position, ...)."""
    path = Path(path)
    verify_checkpoint(path)
    load_adapters(model, checkpoint_adapters(path, adapter_names(model)))
    restore_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return json.loads((path / "trainer_state.json").read_text())


MOMENTS = ("exp_avg", "exp_avg_sq")


def optimizer_state_by_name(model, optimizer) -> dict:
    """The optimizer's state keyed by name, as a checkpoint stores it: each moment by the LoRA
    weight of the unscanned model it belongs to ("<module path>.lora_A.<adapter>.weight"), the
    step counts by adapter. Nothing depends on the order of the config's adapters or on the
    layers being scanned."""
    state = optimizer.state_dict()
    names = per_layer_lora_names(model)
    for key in MOMENTS:
        state[key] = dict(zip(names, per_layer_lora(model, state[key]), strict=True))
    state["steps"] = dict(zip(adapter_names(model), state["steps"].reshape(-1), strict=True))
    return state


def load_optimizer_state(path: str | Path, *, model, optimizer) -> None:
    """The optimizer state of checkpoint `path` (verified by load_checkpoint) into `optimizer`,
    each moment to the LoRA weight of its name (stacked for `model`'s scanned layers), each
    step count to its adapter. (A checkpoint of an earlier version lists them in order.)"""
    file = Path(path) / "optimizer.pt"
    state = torch.load(file, map_location="cpu", weights_only=True)
    try:
        names = per_layer_lora_names(model)
        for key in MOMENTS:
            state[key] = stacked_lora(model, by_name(state[key], names, "LoRA weights"))
        if isinstance(state["steps"], dict):
            state["steps"] = torch.stack(by_name(state["steps"], adapter_names(model), "adapters"))
        optimizer.load_state_dict(state)
    except ValueError as err:
        raise ValueError(f"{file} does not fit this model's LoRA: {err}") from None


def by_name(saved: dict | list, names: list[str], what: str) -> list:
    """`saved` ({name: value}) in the order of `names`; a list (an earlier format) as it is."""
    if not isinstance(saved, dict):
        return saved
    missing, unexpected = [n for n in names if n not in saved], [n for n in saved if n not in names]
    if missing or unexpected:
        raise ValueError(f"its {what} are not this model's: {len(missing)} missing (first {missing[:1]}), "
                         f"{len(unexpected)} not in the model (first {unexpected[:1]})")
    return [saved[n] for n in names]


class Checkpointer:
    """A phase's checkpoints: when to save, saving on every replica together, and what a failed
    write does to the run.

    Every replica calls `save` at the same step; the master writes, then all of them vote on
    whether the write succeeded (a host collective), so a full disk on the master stops every
    replica with the same CheckpointWriteError (exit 3) instead of leaving them waiting for a
    master that has gone."""

    def __init__(
        self, root: Path, *, every: int, keep: int, collectives, base_model: str,
        lora_config: dict[str, LoraConfig], sync
    ) -> None:
        """sync: the runtime's step boundary, so that what is saved has been computed."""
        self.sync = sync
        self.root = Path(root)
        self.every = every
        self.keep = keep
        self.collectives = collectives
        self.base_model = base_model
        self.lora_config = lora_config

    @property
    def master(self) -> bool:
        return self.collectives.rank == 0

    def clean(self) -> None:
        """Remove what an interrupted save left behind (master), before anything is written."""
        if self.master:
            clean_partial_checkpoints(self.root)
        self.collectives.barrier()

    def due(self, step: int, max_steps: int) -> bool:
        """The periodic cadence (the end of a phase and a stop always save)."""
        return bool(self.every) and step % self.every == 0 and step < max_steps

    def latest(self) -> Path | None:
        found = complete_checkpoints(self.root)
        return found[-1] if found else None

    def save(self, step: int, *, model, optimizer, trainer_state: dict) -> None:
        """Every replica, at the same step (after the step's boundary)."""
        self.sync()
        error, rescued = None, None
        parts = {"model": model, "optimizer": optimizer, "trainer_state": trainer_state}
        if self.master:
            try:
                save_checkpoint(self.root, step, lora_config=self.lora_config, base_model=self.base_model,
                                keep=self.keep, **parts)
            except OSError as err:
                error = err
                rescued = self.rescue(step, **parts)
        if self.collectives.all(error is None):
            return
        if error is None:
            raise CheckpointWriteError(f"the master could not write checkpoint step {step} under {self.root} (its "
                                       "log says why and where the step's checkpoint was kept)")
        cause = f"could not write checkpoint step {step} under {self.root}: {error.strerror or error}"
        if rescued is not None:
            raise CheckpointWriteError(f"{cause}. It was written to {rescued} instead, so no step is lost: free "
                                       f"space (or fix permissions) and rerun with --resume {rescued}")
        latest = self.latest()
        intact = f"The previous checkpoint {latest} is intact" if latest else "No earlier checkpoint exists"
        raise CheckpointWriteError(f"{cause}, nor under {tempfile.gettempdir()}. {intact}; free space (or fix "
                                   "permissions) and rerun with --resume auto")

    def rescue(self, step: int, **parts) -> Path | None:
        """The checkpoint the output disk refused, written under the system's temporary directory
        (often another disk) so that the steps since the last checkpoint (a whole phase with
        checkpoint.every=0) outlive a full or read-only output disk; None if that fails too."""
        root = None
        try:
            root = Path(tempfile.mkdtemp(prefix=f"rescued-{self.root.parent.name}-checkpoint-"))
            return save_checkpoint(root, step, lora_config=self.lora_config, base_model=self.base_model, keep=1,
                                   **parts)
        except OSError:
            if root is not None:
                shutil.rmtree(root, ignore_errors=True)
            return None
