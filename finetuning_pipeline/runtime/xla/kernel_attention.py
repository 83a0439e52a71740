"""Pallas attention kernels on TPU (`model.attention: auto | dense | splash | flash`).

Dense attention materialises [B, heads, L, L] scores: O(L^2) memory that rules out long
contexts. torch_xla 2.9 ships two Pallas kernels that never form the square:
- splash (`torch_xla.experimental.splash_attention`): causal, segment ids (packing), a local
  sliding window, logit soft-capping; SPMD only, on a mesh with `data` and `fsdp` axes
  (parallel.mode=fsdp). It takes no softmax scale: the query is scaled before the call.
- flash (`custom_kernel.flash_attention`): causal, segment ids; no window, no soft-cap, no
  grouped KV (the KV heads are repeated); its `sm_scale` defaults to 1.0, not 1/sqrt(d), so
  the model's own scaling is passed. Used here without SPMD (segment ids are not supported
  with SPMD in torch_xla 2.9).

Kernels run on TPUs only, so what can be checked on a CPU is checked here: the inputs each
kernel gets (segment ids from `position_ids`, the window in the kernel's convention, the
scale, the head layout) are built by `splash_inputs` / `flash_inputs`, which the tests feed to
a reference implementation of the kernels' documented semantics and compare, through whole
models of every family, with the dense masks of attention_masks.py. The kernel calls
themselves (`call_splash`, `call_flash`) have not run on TPU hardware in this repository.

What the kernels cannot run is decided before the device (`choose_attention`): a generation
they are reported broken on (v2/v3), an install without the jax torch_xla pins, a model feature
(flash: windows, soft-caps, SPMD), a sequence length their blocks do not divide. auto then
takes dense attention and says why; an explicit kernel is a config error. auto also keeps to
dense where flash would run in several dp processes (each tracing the kernel with its own JAX
TPU backend beside torch_xla's: torch_xla runs its kernels single-process or under SPMD only);
an explicit model.attention=flash runs it there, for `make tpu-check` to prove. Splash with
soft-capping goes through our own autograd Function around torch_xla's splash ops, because
torch_xla's wrapper fails at the first backward (`SplashAttentionFunction`).

Wiring: the kernel is registered as a transformers attention implementation; instead of 4D
masks, the forward gets the segment ids as a [B, 1, 1, L] tensor (or a dict of them per layer
type), which transformers hands to every layer's attention as-is, with the layer's own
`scaling`, `sliding_window` and `softcap`.
"""

from __future__ import annotations

import functools

import torch

from finetuning_pipeline.model.attention_masks import ONE_MASK, mask_windows
from utils.tpu_detect import tpu_generation
from utils.tpu_install import pallas_problem
from finetuning_pipeline.runtime.xla.device import device_kind

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


def attention_here(setting: str, model_config, *, spmd_mesh: bool, seq_len: int | None,
                   dp_processes: int = 1) -> tuple[str, str]:
    """choose_attention for the machine this process runs on: its TPU generation read from the
    PCI bus, and whether its install has what the kernels need."""
    tpu = (tpu_generation() or "of unknown generation") if device_kind() == "TPU" else None
    install = pallas_problem() if tpu is not None and setting != "dense" else None
    return choose_attention(setting, model_config, tpu=tpu, spmd_mesh=spmd_mesh, seq_len=seq_len,
                            install_problem=install, dp_processes=dp_processes)


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


def repeat_kv(states: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, kv_heads, L, D] -> [B, heads, L, D], each KV head repeated for its query group."""
    groups = heads // states.shape[1]
    return states if groups == 1 else states.repeat_interleave(groups, dim=1)


def splash_inputs(
    query, key, value, segments, scaling: float, sliding_window: int | None, softcap: float | None
) -> dict:
    """The arguments of one splash call. Its LocalMask admits keys q - w <= k <= q for
    window_size w; transformers' window W admits q - W < k <= q: so w = W - 1."""
    heads = query.shape[1]
    return {"q": query * scaling, "k": repeat_kv(key, heads), "v": repeat_kv(value, heads),
            "segment_ids": segments, "window": None if sliding_window is None else sliding_window - 1,
            "soft_cap": softcap}


def flash_inputs(query, key, value, segments, scaling: float) -> dict:
    heads = query.shape[1]
    return {"q": query, "k": repeat_kv(key, heads), "v": repeat_kv(value, heads), "segment_ids": segments,
            "sm_scale": scaling}


class SplashAttentionFunction(torch.autograd.Function):
    """torch_xla 2.9's splash forward and backward ops (`xla::sa_custom_forward` / `_backward`)
    under an autograd Function that keeps the soft-cap as a Python attribute. torch_xla's own
    `SplashAttention.forward` passes the soft-cap, a float, to `ctx.save_for_backward`, which
    takes tensors only: every soft-capped model (Gemma 2) would fail at its first backward, after
    an evaluation (no gradients) that passes. `ops` is the (forward, backward) pair: torch_xla's
    on a TPU (splash_ops), a reference with the same contract in the CPU tests."""

    @staticmethod
    def forward(ctx, q, k, v, segment_ids, config: str, soft_cap: float | None, ops):
        output = ops[0](q, k, v, config, segment_ids, True, soft_cap)[0]
        ctx.save_for_backward(q, k, v, segment_ids)
        ctx.config, ctx.soft_cap, ctx.ops = config, soft_cap, ops
        return output

    @staticmethod
    def backward(ctx, grad_output):
        q, k, v, segment_ids = ctx.saved_tensors
        grad_q, grad_k, grad_v = ctx.ops[1](grad_output, q, k, v, ctx.config, segment_ids, True, ctx.soft_cap)
        return grad_q, grad_k, grad_v, None, None, None, None


def splash_ops():
    """torch_xla's splash forward and backward ops, each run the way its SplashAttention runs them
    (`requires_jax`: the PJRT client up before jax is imported)."""
    from torch_xla.experimental.custom_kernel import requires_jax
    from torch_xla.experimental.splash_attention import sa_custom_backward, sa_custom_forward

    return requires_jax(sa_custom_forward), requires_jax(sa_custom_backward)


def call_splash(inputs: dict, mesh, ops=None) -> torch.Tensor:
    """torch_xla's splash attention on a (data, fsdp) mesh; returns [B, heads, L, D]."""
    from torch_xla.experimental.splash_attention import SplashAttentionConfig

    config = SplashAttentionConfig(mesh=str(mesh), qkv_partition_spec=(("data", "fsdp"), None, None, None),
                                   segment_ids_partition_spec=(("data", "fsdp"), None),
                                   attentiontype_local_sliding=inputs["window"] is not None,
                                   slide_window_size=inputs["window"])
    return SplashAttentionFunction.apply(inputs["q"], inputs["k"], inputs["v"], inputs["segment_ids"],
                                         config.to_json(), inputs["soft_cap"], ops or splash_ops())


def call_flash(inputs: dict, mesh=None) -> torch.Tensor:
    """torch_xla's flash attention, one process per chip; returns [B, heads, L, D]."""
    from torch_xla.experimental.custom_kernel import flash_attention

    return flash_attention(inputs["q"], inputs["k"], inputs["v"], causal=True, q_segment_ids=inputs["segment_ids"],
                           kv_segment_ids=inputs["segment_ids"], sm_scale=inputs["sm_scale"])


KERNELS = {"splash": call_splash, "flash": call_flash}


def kernel_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     softcap=None, *, kind: str, mesh=None, **kwargs):
    """A transformers attention function: query [B, heads, L, D], key/value [B, kv_heads, L, D],
    `attention_mask` the [B, 1, 1, L] segment ids of kernel_masks. Returns ([B, L, heads, D], None)."""
    segments = attention_mask[:, 0, 0, :].to(torch.int32)
    scaling = module.scaling if scaling is None else scaling
    if kind == "splash":
        inputs = splash_inputs(query, key, value, segments, scaling, sliding_window, softcap)
    else:
        inputs = flash_inputs(query, key, value, segments, scaling)
    output = KERNELS[kind](inputs, mesh)
    return output.transpose(1, 2).contiguous(), None


def enable_kernel_attention(model, kind: str, mesh=None) -> None:
    """Make `model`'s layers call the `kind` kernel (registered as a transformers attention
    implementation); the loss then passes kernel_masks instead of dense ones."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION[kind], functools.partial(kernel_attention, kind=kind, mesh=mesh))
    model.set_attn_implementation(IMPLEMENTATION[kind])


def uses_kernel(model_config) -> bool:
    return getattr(model_config, "_attn_implementation", None) in IMPLEMENTATION.values()
