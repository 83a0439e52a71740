"""Whether a phase runs its decoder layers as one XLA loop (train.scan_layers; the loop itself
is finetuning_pipeline/runtime/xla/layer_scan.py), and what in a model prevents it.

Scanned, one layer is traced and compiled whatever the depth (docs/benchmarks.md, "Host time per step and
compile time"). Not every model can be: its layers must be identical but for their weights (a
Gemma 3's sliding and full layers are not), and random numbers of the model's own dropout
cannot be drawn inside the loop (each layer would draw the same masks); and under
parallel.mode=fsdp (SPMD) the scan is not supported yet. Unset, the setting
scans where the model allows it and the depth makes it pay, and says why not otherwise, as
model.attention "auto" does.
"""

from __future__ import annotations

from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.runtime.xla.layer_scan import scan_decoder_layers, scannable_layers


def model_dropouts(settings) -> dict[str, float]:
    """The model's own dropout probabilities above 0, by config key, whatever the family calls
    them (attention_dropout, hidden_dropout, resid_pdrop, embd_pdrop, ...; nested configs
    too). `settings`: a transformers config or its to_dict()."""
    found = {}
    for key, value in (settings if isinstance(settings, dict) else settings.to_dict()).items():
        name = str(key)
        if isinstance(value, dict):
            found.update({f"{name}.{inner}": p for inner, p in model_dropouts(value).items()})
        elif ("dropout" in name or "pdrop" in name) and type(value) in (int, float) and value > 0:
            found[name] = value
    return found


# Unset, train.scan_layers scans from this depth. Below it the loop does not pay on XLA:CPU:
# per step it slices and writes back every stack (make bench-train's shapes, same run: 2 layers
# 12.9-15.9 vs 10.6-10.8 ms a step; 8 layers 5.49 vs 5.13 s), and its compile time, about
# constant, only wins with depth (8 layers: 6.5 vs 6.2 s; 32 layers: 2.4 vs 13.2 s).
AUTO_MIN_LAYERS = 16


def why_not_scanned(model, spmd: bool, setting: bool | None = None) -> str | None:
    """Why `model`'s decoder layers will not run as one loop in training, or None if they will
    (a weightless meta-device model answers as well: preflight asks one). spmd:
    parallel.mode=fsdp; setting: train.scan_layers."""
    if setting is False:
        return "train.scan_layers=false"
    if spmd:
        # torch_xla's scan shards its backward through JAX (absent here), and with JAX present
        # the scan inside the captured step's micro-batch loop gave other losses than one
        # device (step 1: 6.9602 vs 6.9585 on the fsdp test's model; traced every step: equal).
        return "parallel.mode=fsdp does not run scanned layers yet"
    dropouts = model_dropouts(model.config)
    if dropouts:
        named = ", ".join(f"{name} {p}" for name, p in dropouts.items())
        return f"the model's own dropout ({named}) cannot draw its masks inside the loop"
    try:
        layers = scannable_layers(model)
    except ValueError as err:
        return str(err)
    if setting is None and len(layers) < AUTO_MIN_LAYERS:
        return (f"{len(layers)} layers compile about as fast unrolled (scanned from {AUTO_MIN_LAYERS} layers; "
                "train.scan_layers=true scans anyway)")
    return None


def scan_decision(model, setting: bool | None, spmd: bool) -> str | None:
    """None when the trainer will scan `model`'s decoder layers, else why not (for the log).
    Raises ConfigError when `setting` (train.scan_layers) is True and they cannot be: preflight
    asks the same of a weightless model, so the error comes on a CPU, before a TPU is rented."""
    why_not = why_not_scanned(model, spmd, setting)
    if why_not is not None and setting:
        raise ConfigError(f"train.scan_layers=true, but {why_not}; set train.scan_layers=false "
                          "(or leave it unset: scanned where the model allows it)")
    return why_not


def scan_layers(model, setting: bool | None, activation_checkpointing: bool, spmd: bool) -> str:
    """Scan `model`'s decoder layers (in place, before it moves to the device: the stacking
    then costs host memory, one weight's stack at a time) as `scan_decision` decides; returns
    what was done, for the log. activation_checkpointing: model.activation_checkpointing, done inside the loop.
    spmd: parallel.mode=fsdp."""
    why_not = scan_decision(model, setting, spmd)
    if why_not is not None:
        return f"decoder layers run one by one: {why_not}"
    scanned = scan_decoder_layers(model, activation_checkpointing=activation_checkpointing)
    return (f"decoder layers scanned: {scanned.count} layers run as one XLA loop (one layer traced and compiled)"
            + (", recomputed in the backward (model.activation_checkpointing)" if activation_checkpointing else ""))
