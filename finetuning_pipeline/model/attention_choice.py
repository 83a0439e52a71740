"""Which attention a phase runs (`model.attention: auto | dense | splash | flash`), judged before
any device is touched, and the masks a fused kernel takes instead of dense ones.

torch_xla 2.9's Pallas kernels (runtime/xla/kernel_attention.py, which has their semantics) run on
TPUs only. What the kernels cannot run is decided here (`choose_attention`): a generation they are
reported broken on (v2/v3), an install without the jax torch_xla pins, a model feature (flash:
windows, soft-caps, SPMD), a sequence length their blocks do not divide. auto then takes dense
attention and says why; an explicit kernel is a config error. auto also keeps to dense where
flash would run in several dp processes (each tracing the kernel with its own JAX TPU backend
beside torch_xla's: torch_xla runs its kernels single-process or under SPMD only); an explicit
model.attention=flash runs it there, for `make tpu-check` to prove.

A kernel's forward gets, instead of 4D masks, the segment ids as a [B, 1, 1, L] tensor (or a dict
of them per layer type), which transformers hands to every layer's attention as-is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from finetuning_pipeline.model.attention_masks import ONE_MASK, mask_windows


@dataclass(frozen=True)
class TargetMachine:
    """The machine a run's attention is judged for: its TPU generation (None: no TPU that the
    kernels run on), what its install lacks for the kernels, and what it lacks to run at all
    (each None: nothing). The runtime reads its own (runtime/__init__.target_machine); preflight
    names the TPU it plans, with the tested install."""

    tpu: str | None = None
    pallas_problem: str | None = None
    runtime_problem: str | None = None


CHOICES = ("auto", "dense", "splash", "flash")
# (transformers reads any implementation name containing "flash" as a Hub flash-attention kernel)
IMPLEMENTATION = {"splash": "tpu_splash", "flash": "tpu_pallas_fa"}


# Generations torch_xla's Pallas kernels are reported not to run on: auto never picks a kernel there.
NO_PALLAS = ("v2", "v3", "v2/v3")
# torch_xla 2.9's kernel blocks (custom_kernel.py, splash_attention.py): each is min(block, L),
# and JAX checks that it divides L (`_verify_block`). Flash's forward pads k/v to its block and
# takes any length; its backward pads nothing: dq blocks of 1024 (q) and 512 / 256 (k), dkv
# blocks of 512. Splash uses 2048 everywhere, and its KV blocks must fill the 128 lanes.
FLASH_BACKWARD_BLOCKS = (1024, 512, 256)
SPLASH_BLOCK, LANES = 2048, 128


def _length_fault(kind: str, seq_len: int) -> str | None:
    if kind == "flash":
        blocks = [min(block, seq_len) for block in FLASH_BACKWARD_BLOCKS if seq_len % min(block, seq_len)]
        return f"is not a multiple of {blocks[0]}" if blocks else None
    block = min(SPLASH_BLOCK, seq_len)
    if seq_len % block or block % LANES:
        return f"is not a multiple of {block if seq_len % block else LANES}"
    return None


def length_problem(kind: str, seq_len: int) -> str | None:
    """Why `kind`'s training (forward and backward) cannot run at sequence length `seq_len`, or None."""
    fault = _length_fault(kind, seq_len)
    if fault is None:
        return None
    rule = ("a length its backward's blocks (min(1024, L), min(512, L), min(256, L)) divide" if kind == "flash"
            else f"a multiple of {LANES} (and of {SPLASH_BLOCK} above {SPLASH_BLOCK})")
    fits = next(length for length in range(seq_len + 1, 2 * seq_len + SPLASH_BLOCK)
                if _length_fault(kind, length) is None)
    return f"sequence length {seq_len} {fault}; {kind} attention needs {rule}, e.g. {fits}"


def choose_attention(setting: str, model_config, *, tpu: str | None, spmd_mesh: bool, seq_len: int | None,
                     install_problem: str | None = None, dp_processes: int = 1) -> tuple[str, str]:
    """(kind, why) for model.attention, judged for the TPU generation `tpu` (None: not a TPU),
    training at `seq_len` (None: not known yet), with `install_problem` (utils.tpu_install) of
    the machine that will run it, under dp in `dp_processes` processes. An explicit kernel that
    cannot run raises ValueError naming the key and what to do; auto never picks a kernel for a
    case it does not cover, or that no one has run, and says why."""
    if setting not in CHOICES:
        raise ValueError(f"model.attention must be one of {list(CHOICES)}, got {setting!r}")
    if setting == "dense":
        return "dense", "model.attention=dense"
    if tpu is None:
        if setting != "auto":
            raise ValueError(f"model.attention={setting}: Pallas kernels run on TPU only (PJRT_DEVICE=TPU); "
                             "use model.attention=auto or dense")
        return "dense", "not a TPU: dense attention"
    if tpu in NO_PALLAS:
        if setting != "auto":
            raise ValueError(f"model.attention={setting}: torch_xla's Pallas kernels are reported not to work on TPU "
                             f"{tpu}; use model.attention=auto or dense")
        return "dense", f"dense attention: no Pallas kernels on TPU {tpu}"
    kind = "splash" if setting == "splash" or (setting == "auto" and spmd_mesh) else "flash"
    if kind == "splash" and not spmd_mesh:
        raise ValueError("model.attention=splash needs parallel.mode=fsdp (an SPMD mesh with data and fsdp axes; "
                         "parallel.mesh.data=-1 parallel.mesh.fsdp=1 for pure data parallelism)")
    gaps = []
    if kind == "flash":
        windows = [w for w in mask_windows(model_config).values() if w is not None]
        softcap = getattr(model_config, "attn_logit_softcapping", None)
        gaps += [f"this model needs {why}, which torch_xla's flash attention does not do" for why, gap in
                 (("a sliding window", windows), ("attention soft-capping", softcap),
                  ("an SPMD mesh (its segment ids are not supported under SPMD)", spmd_mesh)) if gap]
    length_gap = length_problem(kind, seq_len) if seq_len is not None else None
    if length_gap:
        gaps.append(length_gap)
    if install_problem:
        gaps.append(f"the Pallas kernels cannot be traced here: {install_problem}")
    if gaps:
        if setting != "auto":
            raise ValueError(f"model.attention={kind}: {'; '.join(gaps)}; or use model.attention=auto or dense")
        return "dense", f"dense attention, not {kind}: {'; '.join(gaps)}"
    if kind == "splash":
        return "splash", "splash attention: the SPMD mesh has data and fsdp axes"
    if setting == "auto" and dp_processes > 1:
        # Each process would start JAX's own TPU backend beside torch_xla's to trace the kernel
        # (jax.jit(...).lower()); torch_xla runs its kernels single-process or under SPMD only.
        return "dense", (f"dense attention, not flash: flash in {dp_processes} dp processes (each tracing the "
                         "kernel with its own JAX TPU backend) has not been run; model.attention=flash tries it "
                         "(run make tpu-check first), parallel.mode=fsdp takes splash")
    return "flash", "flash attention: no window, no soft-cap, one process"


def segment_ids(position_ids: torch.Tensor | None, batch: int, length: int, device) -> torch.Tensor:
    """int32 [B, L]: samples numbered from 1 within each row, a new one wherever the position
    restarts at 0 (all 1 for a plain row). Tokens attend only within their own number."""
    if position_ids is None:
        return torch.ones(batch, length, dtype=torch.int32, device=device)
    return torch.cumsum((position_ids == 0).to(torch.int32), dim=-1)


def kernel_masks(model_config, segments: torch.Tensor):
    """What a kernel forward passes as `attention_mask`: the segment ids as [B, 1, 1, L] (4D,
    so transformers hands them to the layers as-is), per layer type where the model has types."""
    carried = segments[:, None, None, :]
    windows = mask_windows(model_config)
    if ONE_MASK in windows:
        return carried
    return {layer_type: carried for layer_type in windows}


def uses_kernel(model_config) -> bool:
    return getattr(model_config, "_attn_implementation", None) in IMPLEMENTATION.values()
