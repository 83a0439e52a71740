"""The LoRA on the real XLA path (PJRT_DEVICE=CPU): forward, backward, a step, a save."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch_xla
from conftest import REPO, random_tokens, tiny_causal_lm
from tolerances import assert_equal_in_exact_arithmetic

from lora_logic.adapter_io import load_adapters, save_adapters
from lora_logic.adapters import lora_modules, lora_parameters
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora
from utils.precision import float64_throughout


def with_random_b(model):
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B["default"].weight.copy_(torch.randn(m.lora_B["default"].weight.shape, generator=generator) * 0.1)
    return model


def test_forward_backward_on_xla_matches_cpu():
    """XLA's compiled graph and eager CPU kernels sum in other orders: equal in exact arithmetic,
    so compared in float64 (tests/tolerances.py)."""
    config = LoraConfig(r=4, alpha=8)
    cpu_model = tiny_causal_lm("mistral").to(torch.float64)
    inject_lora(cpu_model, config)
    with_random_b(cpu_model)
    device = torch_xla.device()
    xla_model = copy.deepcopy(cpu_model).to(device)
    tokens = random_tokens(seq=16)

    with float64_throughout(torch.float64):
        cpu_loss = cpu_model(tokens, labels=tokens, use_cache=False).loss
        cpu_loss.backward()
        xla_tokens = tokens.to(device)
        xla_loss = xla_model(xla_tokens, labels=xla_tokens, use_cache=False).loss
        xla_loss.backward()
    torch_xla.sync()

    assert xla_loss.device.type == "xla" and xla_loss.dtype == torch.float64
    assert_equal_in_exact_arithmetic(xla_loss.cpu(), cpu_loss.detach(), "loss")
    for (name, p_cpu), p_xla in zip(cpu_model.named_parameters(), xla_model.parameters()):
        if p_cpu.requires_grad:
            assert p_cpu.grad.abs().max() > 0, name
            assert_equal_in_exact_arithmetic(p_xla.grad.cpu(), p_cpu.grad, f"{name} gradient")
        else:
            assert p_xla.grad is None, name


@pytest.mark.heavy
def test_optimizer_step_on_xla_then_save_and_load_on_cpu(tmp_path):
    """Trained on XLA, read back on the CPU: the same logits in exact arithmetic, so float64."""
    config = LoraConfig(r=4, alpha=8)
    device = torch_xla.device()
    model = tiny_causal_lm("mistral").to(torch.float64)
    inject_lora(model, config)
    model.to(device)
    frozen_before = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    tokens = random_tokens(seq=16).to(device)
    for _ in range(2):
        with float64_throughout(torch.float64):
            model(tokens, labels=tokens, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p.detach().cpu(), frozen_before[name]), name

    save_adapters(model, tmp_path, config, "tiny-mistral")
    reloaded = tiny_causal_lm("mistral").to(torch.float64)
    load_adapters(reloaded, tmp_path)
    assert any(torch.count_nonzero(m.lora_B["default"].weight) > 0 for _, m in lora_modules(reloaded))  # it trained
    assert all(p.dtype == torch.float64 for p in lora_parameters(reloaded))  # read back as written
    with torch.no_grad(), float64_throughout(torch.float64):
        on_xla = model.eval()(tokens, use_cache=False).logits.cpu()
        on_cpu = reloaded(tokens.cpu(), use_cache=False).logits
    assert_equal_in_exact_arithmetic(on_xla, on_cpu, "logits")


def test_bf16_base_on_xla_trains_fp32_adapter():
    model = tiny_causal_lm("llama").to(torch.bfloat16)
    inject_lora(model, LoraConfig(r=4, alpha=8))
    device = torch_xla.device()
    model.to(device)
    tokens = random_tokens(seq=16).to(device)
    loss = model(tokens, labels=tokens, use_cache=False).loss
    loss.backward()
    torch_xla.sync()
    assert torch.isfinite(loss.float().cpu())
    for p in lora_parameters(model):
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32


ALIASED_INPUTS = """
import torch, torch_xla
import torch_xla.debug.metrics as met
from finetuning_pipeline.runtime.xla.device import init_xla_device
weight = torch.zeros(7, 13).to(init_xla_device())
torch_xla.sync()
weight.add_(1.0)  # what every optimizer step does to the LoRA weights
torch_xla.sync()
assert weight.cpu().sum().item() == 7 * 13
samples = met.metric_data("InputOutputAliasCount")
print(int(samples[2][-1][1]) if samples else 0)  # inputs aliased to outputs by the last graph compiled
"""


def aliased_inputs(env: dict) -> int:
    """The in-place update's graph in a fresh process (its graph cache empty, so it is compiled
    there, whatever this process compiled before): how many inputs it donated to outputs."""
    done = subprocess.run([sys.executable, "-c", ALIASED_INPUTS], capture_output=True, text=True, timeout=300,
                          env={**{k: v for k, v in os.environ.items() if k != "XLA_ENABLE_PARAM_ALIASING"}, **env},
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.heavy
def test_on_xla_cpu_an_in_place_update_donates_no_buffer():
    """init_xla_device turns parameter aliasing off on XLA:CPU (a donated buffer makes every
    step boundary wait for the step to run there); accelerators keep torch_xla's default, and
    an explicit setting wins: with it on, the same update donates its input (so the count
    read here does see a donation when there is one)."""
    from finetuning_pipeline.runtime.xla.device import runtime_env_defaults

    assert runtime_env_defaults("CPU") == {"XLA_ENABLE_PARAM_ALIASING": "0"}
    assert runtime_env_defaults("TPU") == {}
    assert aliased_inputs({"PJRT_DEVICE": "CPU"}) == 0
    assert aliased_inputs({"PJRT_DEVICE": "CPU", "XLA_ENABLE_PARAM_ALIASING": "1"}) >= 1


# In the order of a TPU launcher's worker: the device chosen (in the launching process, whose
# environment the worker inherits), the runtime started (compile cache, topology), and only
# then init_xla_device in a replica. Then a row sum over 512 elements and an elementwise update
# of a [16, 192] tensor (a LoRA A's write-back).
COMPILE_TWO_KERNELS = """
import sys, torch, torch_xla.runtime as xr
from finetuning_pipeline.runtime.xla.device import choose_device, init_xla_device
choose_device()
xr.initialize_cache(sys.argv[1], readonly=False)
assert xr.global_runtime_device_count() >= 1
device = init_xla_device()
x = torch.rand(4, 512).to(device)
(x * x).sum(-1).cpu()
p, g = torch.rand(16, 192).to(device), torch.rand(16, 192).to(device)
(p - 0.5 * g).cpu()
"""
# Each of our XLA:CPU compiler defaults overridden by the user, with XLA's own default as the value.
XLAS_DEFAULTS = "--xla_disable_hlo_passes=none --xla_backend_extra_options=xla_none"


@pytest.fixture(scope="module")
def xla_dumps(tmp_path_factory) -> dict[str, Path]:
    """XLA's dumps of COMPILE_TWO_KERNELS, each in a fresh process: "ours" with our defaults
    (choose_device adds them), "xla's" with the user's XLA_FLAGS giving XLA's defaults back."""
    dumps = {}
    for name, xla_flags in (("ours", ""), ("xla's", XLAS_DEFAULTS)):
        dumps[name] = tmp_path_factory.mktemp("dump")
        env = {**os.environ, "PJRT_DEVICE": "CPU",
               "XLA_FLAGS": f"{xla_flags} --xla_dump_to={dumps[name]} --xla_dump_hlo_as_text"}
        done = subprocess.run([sys.executable, "-c", COMPILE_TWO_KERNELS, str(dumps[name] / "cache")],
                              capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
        assert done.returncode == 0, done.stderr
    return dumps


def optimized_hlo(dump: Path) -> str:
    return "\n".join(hlo.read_text() for hlo in dump.glob("*cpu_after_optimizations.txt"))


@pytest.mark.heavy
def test_on_xla_cpu_a_long_reduction_is_one_fused_kernel_unless_the_user_says_otherwise(xla_dumps):
    """choose_device turns XLA:CPU's tree reduction rewriter off (it splits a reduction into a
    reduce-window and a reduce, compiled unfused at every occurrence), in time for a runtime
    started before init_xla_device; a user's own xla_disable_hlo_passes wins, and with the pass
    left on, the same sum is split (so the HLO read here does show the split when it happens)."""
    from finetuning_pipeline.runtime.xla.device import with_compiler_defaults

    assert with_compiler_defaults("", "TPU") == ""
    assert with_compiler_defaults("--xla_dump_to=/d", "cpu") == (
        "--xla_dump_to=/d --xla_disable_hlo_passes=tree_reduction_rewriter "
        "--xla_backend_extra_options=xla_cpu_disable_loop_unrolling")
    ours = optimized_hlo(xla_dumps["ours"])
    assert "reduce-window" not in ours and " reduce(" in ours
    assert "reduce-window" in optimized_hlo(xla_dumps["xla's"])


@pytest.mark.heavy
def test_on_xla_cpu_a_kernel_keeps_its_loop_unless_the_user_says_otherwise(xla_dumps):
    """choose_device turns LLVM's loop unrolling off for XLA:CPU: the [16, 192] update compiles
    to a vectorized loop, a few vector stores in its optimized IR, where with unrolling (the
    user's own xla_backend_extra_options) LLVM writes out every one of its 384 8-wide stores."""
    def vector_stores(dump: Path) -> int:
        # The kernel whose buffers are [16, 192] fp32, 12288 bytes (the row sum's: 8 KB and 16 bytes),
        # as XLA emitted it; then its IR as LLVM optimized it.
        (emitted,) = [ir for ir in dump.glob("*.ir-no-opt.ll") if "dereferenceable(12288)" in ir.read_text()]
        return Path(str(emitted).replace(".ir-no-opt.ll", ".ir-with-opt.ll")).read_text().count("store <")

    assert 1 <= vector_stores(xla_dumps["ours"]) <= 8
    assert vector_stores(xla_dumps["xla's"]) >= 16 * 192 // 16
