"""Which attention a run gets, decided before any device is touched (kernel_attention.choose_attention),
and the splash path that soft-capped models take (SplashAttentionFunction), run on a CPU with
torch_xla's splash ops replaced by a reference with the same contract."""

from __future__ import annotations

import pytest
import torch
from model_families import FAMILIES, reference_kernel, reference_splash_ops
from tolerances import assert_equal_in_exact_arithmetic

from finetuning_pipeline.model.attention_choice import choose_attention, length_problem
from finetuning_pipeline.runtime.xla import kernel_attention

LLAMA, GEMMA2 = FAMILIES["llama"](), FAMILIES["gemma2"]()


def choose(setting, model_config=LLAMA, tpu="v5e", spmd=False, seq_len=1024, install=None):
    return choose_attention(setting, model_config, tpu=tpu, spmd_mesh=spmd, seq_len=seq_len, install_problem=install)


def test_auto_picks_a_kernel_only_where_it_covers_the_model():
    assert choose("auto", tpu=None)[0] == "dense"
    assert choose("auto")[0] == "flash"
    assert choose("auto", spmd=True)[0] == "splash"
    kind, why = choose("auto", GEMMA2)
    assert kind == "dense" and "sliding window" in why and "soft-capping" in why
    assert choose("auto", GEMMA2, spmd=True)[0] == "splash"  # soft-capped: through SplashAttentionFunction
    for setting, model_config, tpu, spmd, message in (
            ("splash", LLAMA, None, True, "run on TPU only"),
            ("splash", LLAMA, "v5e", False, "needs parallel.mode=fsdp"),
            ("flash", GEMMA2, "v5e", False, "does not do"),
            ("sparse", LLAMA, "v5e", False, "must be one of")):
        with pytest.raises(ValueError, match=message):
            choose(setting, model_config, tpu=tpu, spmd=spmd)


def test_auto_keeps_to_dense_where_flash_would_run_in_several_dp_processes():
    """Each dp process would trace the kernel with its own JAX TPU backend beside torch_xla's,
    which torch_xla never does (its kernels run single-process or under SPMD): not the default
    until a TPU has run it; a named model.attention=flash runs it (make tpu-check proves it)."""
    def several(setting, spmd=False, processes=8):
        return choose_attention(setting, LLAMA, tpu="v5e", spmd_mesh=spmd, seq_len=1024, dp_processes=processes)

    kind, why = several("auto")
    assert kind == "dense" and "flash in 8 dp processes" in why and "model.attention=flash tries it" in why
    assert several("flash")[0] == "flash"
    assert several("auto", processes=1)[0] == "flash"  # one chip (parallel.single_chip, v5e-1)
    assert several("auto", spmd=True)[0] == "splash"


@pytest.mark.parametrize("kind, fits, misfits", [
    ("flash", [64, 128, 200, 256, 512, 1024, 2048, 3072, 8192], [384, 768, 1536, 2560]),
    ("splash", [128, 256, 384, 2048, 4096, 8192], [64, 200, 3072, 6144 + 128]),
])
def test_a_length_the_kernels_blocks_do_not_divide_is_refused_or_routed_to_dense(kind, fits, misfits):
    """torch_xla 2.9's blocks: flash's backward min(1024 | 512 | 256, L), splash min(2048, L) in
    multiples of 128 lanes (768 with flash fails at the backward's trace, on the TPU)."""
    spmd = kind == "splash"
    for seq_len in fits:
        assert length_problem(kind, seq_len) is None, seq_len
        assert choose(kind, spmd=spmd, seq_len=seq_len)[0] == kind
    for seq_len in misfits:
        problem = length_problem(kind, seq_len)
        fitting = int(problem.rsplit("e.g. ", 1)[1])
        assert fitting > seq_len and length_problem(kind, fitting) is None
        with pytest.raises(ValueError, match=f"model.attention={kind}: sequence length {seq_len} is not a multiple"):
            choose(kind, spmd=spmd, seq_len=seq_len)
        kind_chosen, why = choose("auto", spmd=spmd, seq_len=seq_len)
        assert kind_chosen == "dense" and f"sequence length {seq_len}" in why


def test_tpu_v2_and_v3_get_no_pallas_kernel():
    for generation in ("v2", "v3", "v2/v3"):
        kind, why = choose("auto", tpu=generation, spmd=True)
        assert kind == "dense" and generation in why
        with pytest.raises(ValueError, match=f"not to work on TPU {generation}; use model.attention=auto or dense"):
            choose("flash", tpu=generation)
    assert choose("auto", tpu="v4")[0] == "flash"


def test_without_the_pinned_jax_auto_falls_back_and_a_named_kernel_names_the_install():
    missing = "jax is not installed (torch_xla's pallas extra pins jax==0.7.1) (pip install -e '.[tpu]')"
    kind, why = choose("auto", install=missing)
    assert kind == "dense" and "pip install -e '.[tpu]'" in why
    with pytest.raises(ValueError, match="model.attention=splash: the Pallas kernels cannot be traced here: jax is"):
        choose("splash", spmd=True, install=missing)


def test_this_machines_generation_and_install_are_what_a_run_is_judged_by(monkeypatch):
    """attention_here reads the TPU generation from the PCI bus and the install from the package
    metadata: on a v3 host no kernel; on a v5e host without jax, dense with the reason."""
    monkeypatch.setattr(kernel_attention, "device_kind", lambda: "TPU")
    monkeypatch.setattr(kernel_attention, "tpu_generation", lambda: "v2/v3")
    assert "no Pallas kernels on TPU v2/v3" in kernel_attention.attention_here("auto", LLAMA, spmd_mesh=False,
                                                                                 seq_len=1024)[1]
    monkeypatch.setattr(kernel_attention, "tpu_generation", lambda: "v5e")
    monkeypatch.setattr(kernel_attention, "pallas_problem", lambda: "jax is not installed")
    kind, why = kernel_attention.attention_here("auto", LLAMA, spmd_mesh=False, seq_len=1024)
    assert kind == "dense" and "jax is not installed" in why
    monkeypatch.setattr(kernel_attention, "pallas_problem", lambda: None)
    assert kernel_attention.attention_here("auto", LLAMA, spmd_mesh=False, seq_len=1024)[0] == "flash"
    monkeypatch.setattr(kernel_attention, "device_kind", lambda: "CPU")
    assert kernel_attention.attention_here("auto", LLAMA, spmd_mesh=False, seq_len=1024)[0] == "dense"


def splash_case(soft_cap=30.0, window=None):
    generator = torch.Generator().manual_seed(3)
    # float64: the kernel's contract and the reference semantics sum in other orders (tolerances.py)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=generator, dtype=torch.float64) * 4 for _ in range(3))
    segments = torch.tensor([[1] * 10 + [2] * 6, [1] * 16], dtype=torch.int32)
    return {"q": q, "k": k, "v": v, "segment_ids": segments, "soft_cap": soft_cap, "window": window}


@pytest.mark.parametrize("window", [None, 5])
def test_soft_capped_splash_trains_through_our_function_with_the_kernels_gradients(window):
    """Gradients through SplashAttentionFunction (torch_xla's op contract, reference ops) equal
    autograd through the reference semantics: the soft-cap reaches the backward op intact."""
    case = splash_case(window=window)
    leaves = {name: case[name].clone().requires_grad_() for name in "qkv"}
    output = kernel_attention.call_splash({**case, **leaves}, mesh=None, ops=reference_splash_ops())
    output.square().sum().backward()
    ours = [leaves[name].grad for name in "qkv"]
    expected_leaves = {name: case[name].clone().requires_grad_() for name in "qkv"}
    expected = reference_kernel("splash")({**case, **expected_leaves})
    assert output.dtype == torch.float64
    assert_equal_in_exact_arithmetic(output, expected, "splash output")
    expected.square().sum().backward()
    for name, got, want in zip("qkv", ours, [expected_leaves[name].grad for name in "qkv"]):
        assert_equal_in_exact_arithmetic(got, want, f"d{name}")
    assert max(g.abs().max().item() for g in ours) > 0


def test_torch_xlas_own_splash_wrapper_fails_on_a_soft_cap(monkeypatch):
    """The fault our Function routes around, shown on a CPU with the same reference op: torch_xla
    2.9's SplashAttention hands the soft-cap (a float) to save_for_backward."""
    from torch_xla.experimental import splash_attention as xla_splash

    forward, _ = reference_splash_ops()
    monkeypatch.setattr(xla_splash, "sa_custom_forward", forward)
    case = splash_case()
    config = xla_splash.SplashAttentionConfig(mesh="None", qkv_partition_spec=(("data", "fsdp"), None, None, None),
                                              segment_ids_partition_spec=(("data", "fsdp"), None)).to_json()
    with pytest.raises(TypeError, match="save_for_backward"):
        xla_splash.SplashAttention.apply(case["q"].requires_grad_(), case["k"], case["v"], config,
                                         case["segment_ids"], True, case["soft_cap"])
