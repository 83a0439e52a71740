"""What a run's inputs must satisfy before any device is touched: the model (a Hub id pinned to
its commit), the prepared data against the tokenizer and the model, the LoRA targets, the
adapters of earlier phases a phase builds on, and an output directory that can be written. main.py runs
these checks before training, and preflight before planning."""

from __future__ import annotations

import os
from pathlib import Path

from dataset.loader import open_prepared
from dataset.manifest import tokenizer_fingerprint
from dataset.shards import PREFERENCE
from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.model.attention_choice import TargetMachine, choose_attention
from finetuning_pipeline.model.attention_masks import mask_windows
from finetuning_pipeline.model.causal_lm_loss import resolve_chunk_tokens
from finetuning_pipeline.model.loading import check_lora_rank, check_lora_targets, check_quantizable
from finetuning_pipeline.run.run_layout import RunLayout
from finetuning_pipeline.run_config import RunConfig
from utils.hub_models import model_dir, resolve_model
from utils.tokenizer_loading import load_extended_tokenizer


def check_inputs(config: RunConfig, phases: list[int], *, machine: TargetMachine = TargetMachine()) -> None:
    """Everything that can fail before a device is touched; raises ConfigError / DataError /
    HubModelError. The attention kernels are judged for `machine`: the one the run's runtime runs
    on (runtime.target_machine), or the TPU preflight plans from a CPU, with the tested install."""
    from transformers import AutoConfig  # seconds to import: not for `main.py --help`

    if machine.runtime_problem:
        raise ConfigError(f"PJRT_DEVICE=TPU: {machine.runtime_problem}")
    files = Path(model_dir(config.model.path, config.model.revision))  # a Hub id: its snapshot, pinned by pin_model
    if not (files / "config.json").is_file():
        raise ConfigError(f"model.path: {files} has no config.json (a local Hugging Face model directory or a "
                          "Hub id is expected)")
    model_config = AutoConfig.from_pretrained(files)
    try:
        resolve_chunk_tokens(config.train.loss_chunk_tokens, model_config)
        mask_windows(model_config)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    tokenizer = load_extended_tokenizer(config.model.tokenizer or files,
                                        "model.tokenizer" if config.model.tokenizer else "model.path",
                                        config.model.new_tokens, "model.new_tokens")
    fingerprint = tokenizer_fingerprint(tokenizer)
    max_positions = getattr(model_config, "max_position_embeddings", None)
    lengths: dict[int, dict[str, int]] = {}
    kinds: dict[int, dict[str, bool]] = {}  # whether each adapter's data of a phase is preference pairs
    for phase, key, data in phase_data(config, phases):
        if not data:
            raise ConfigError(f"{key}: not set (a directory written by `python -m dataset.prepare`)")
        if Path(data).is_file():
            raise ConfigError(f"{key}: {data} is a file; a phase reads prepared data, the directory `python -m "
                              f"dataset.prepare --input {data} --out DIR` writes: set {key} to that DIR")
        if not Path(data).is_dir():
            raise ConfigError(f"{key}: {data} does not exist; run `python -m dataset.prepare ... --out {data}` first")
        manifest = open_prepared(data, fingerprint=fingerprint, seq_len=config.phase(phase).seq_len,
                                 setting=f"phase{phase}.seq_len", new_tokens=config.model.new_tokens)
        kinds.setdefault(phase, {})[key] = manifest.get("phase") == PREFERENCE
        if len(set(kinds[phase].values())) > 1:  # adapters side by side share one loss
            pairs = [k for k, v in kinds[phase].items() if v]
            raise ConfigError(f"phase{phase}.adapters: side by side, every adapter's data is of one kind; "
                              f"{', '.join(pairs)} hold preference pairs, the others next-token data. Train them "
                              "in phases of their own")
        if manifest.get("phase") == PREFERENCE and config.phase(phase).adapters and \
                config.phase(phase).preference.precompute_reference:
            raise ConfigError(f"phase{phase}.preference.precompute_reference: not for adapters side by side yet; "
                              f"set phase{phase}.preference.precompute_reference=false (each step then runs the "
                              "reference's forward)")
        if max_positions is not None and manifest["seq_len"] > max_positions:
            raise ConfigError(
                f"{key}: seq_len {manifest['seq_len']} exceeds the model's max_position_embeddings {max_positions}"
            )
        if manifest["counts"]["train"] < 1:
            raise ConfigError(f"{key}: {data} has no training blocks")
        check_micro_batches(config, key, data, manifest["counts"])
        lengths.setdefault(phase, {})[key] = manifest["seq_len"]
        if len(set(lengths[phase].values())) > 1:  # adapters side by side share one batch shape
            raise ConfigError(f"phase{phase}.adapters: side by side, every adapter's data has one sequence length; "
                              f"these differ: {lengths[phase]}. Prepare them at one --seq-len")
        spmd_mesh = config.parallel.mode == "fsdp"
        try:
            choose_attention(config.model.attention, model_config, tpu=machine.tpu, spmd_mesh=spmd_mesh,
                             seq_len=manifest["seq_len"], install_problem=machine.pallas_problem)
        except ValueError as err:
            raise ConfigError(f"{err} ({key} is prepared at seq_len {manifest['seq_len']})") from None
    if any(config.lineage(phase)[1] is None for phase in phases):
        try:  # a phase that continues an adapter trains it with that adapter's own targets
            check_lora_targets(model_config, config.lora_config())
        except ValueError as err:
            raise ConfigError(f"lora.target_modules: {err}") from None
        try:
            check_lora_rank(model_config, config.lora_config())
        except ValueError as err:
            raise ConfigError(str(err)) from None
    try:
        check_quantizable(model_config, config.model.quantize)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_earlier_adapters(config, phases)
    if config.logging.wandb.project:
        try:
            import wandb  # noqa: F401 - only whether it imports
        except ImportError:
            raise ConfigError("logging.wandb.project is set but the wandb package is not installed: pip install "
                              "'tpu-lora[wandb]' (or pip install wandb), or unset logging.wandb.project") from None
    inputs = {"model.path": str(files), "model.tokenizer": config.model.tokenizer,
              **{key: data for _, key, data in phase_data(config, config.phase_numbers())}}
    RunLayout(config.output_dir).check_apart_from(inputs)
    probe_output_dir(config.output_dir)


def check_micro_batches(config: RunConfig, key: str, data: str, counts: dict) -> None:
    """A micro-batch (train.micro_batch, eval.micro_batch) is bounded by the data's size before its
    arrays are allocated on the host and the device: one larger than the phase's blocks would hold
    every block several times over (and train.micro_batch=100000 asks for gigabytes a step). Each
    is bounded by its own split's blocks: the training micro-batch by the training blocks (the eval
    blocks are never trained on), the eval micro-batch by the eval blocks."""
    for setting, value, split in (("train.micro_batch", config.train.micro_batch, "train"),
                                  ("eval.micro_batch", config.eval.micro_batch, "eval")):
        blocks = counts.get(split, 0)
        if value is not None and blocks and value > blocks:
            raise ConfigError(f"{setting}={value}: more rows than {key} holds ({data}: {counts['train']} training "
                              f"and {counts.get('eval', 0)} eval blocks); a micro-batch would repeat its {split} "
                              f"blocks. Choose {setting} <= {blocks}, or prepare more data")


def phase_data(config: RunConfig, phases: list[int]) -> list[tuple[int, str, str]]:
    """(phase, the config key that sets it, prepared data directory) of each of the phases' data."""
    return [(phase, config.data_key(phase, name), data) for phase in phases
            for name, data in config.data_dirs(phase).items()]


def check_earlier_adapters(config: RunConfig, phases: list[int]) -> None:
    """A phase that continues or merges earlier phases' adapters needs those this run does not
    train first on disk (`--phase 3` after phases 1 and 2 finished)."""
    layout = RunLayout(config.output_dir)
    for phase in phases:
        merged, continued = config.lineage(phase)
        for earlier in merged + ([continued] if continued else []):
            if earlier in phases and earlier < phase:
                continue
            adapter = layout.adapter(earlier)
            if not (adapter / "adapter_config.json").is_file():
                raise ConfigError(f"phase{phase}.init={config.phase(phase).init} needs the phase-{earlier} adapter "
                                  f"({adapter}); run phase {earlier} first, or set phase{phase}.init=fresh")


def pin_model(config: RunConfig) -> None:
    """A Hub id in model.path is downloaded now, once, and pinned to the commit it resolves to
    (config.model.revision): every replica loads those files, and the checkpoints and the
    summary record the commit, so a resume cannot silently train on other weights. A Hub id
    that cannot be resolved is a HubModelError (exit 2, errors.py)."""
    config.model.revision = resolve_model(config.model.path, config.model.revision).commit


def probe_output_dir(output_dir: str) -> None:
    """Fail now, not at the first checkpoint, if the outputs cannot be written."""
    path = Path(output_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"output_dir: cannot write to {path} ({err.strerror}); choose another output_dir") from None
