"""The LoRA on the real XLA path (PJRT_DEVICE=CPU): forward, backward, a step, a save."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

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
from utils.xla_runtime import init_xla_device
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


def test_on_xla_cpu_an_in_place_update_donates_no_buffer():
    """init_xla_device turns parameter aliasing off on XLA:CPU (a donated buffer makes every
    step boundary wait for the step to run there); accelerators keep torch_xla's default, and
    an explicit setting wins: with it on, the same update donates its input (so the count
    read here does see a donation when there is one)."""
    from utils.xla_runtime import runtime_env_defaults

    assert runtime_env_defaults("CPU") == {"XLA_ENABLE_PARAM_ALIASING": "0"}
    assert runtime_env_defaults("TPU") == {}
    assert aliased_inputs({"PJRT_DEVICE": "CPU"}) == 0
    assert aliased_inputs({"PJRT_DEVICE": "CPU", "XLA_ENABLE_PARAM_ALIASING": "1"}) >= 1


# In the order of a TPU launcher's worker: the device chosen (in the launching process, whose
# environment the worker inherits), the runtime started (compile cache, topology), and only
# then init_xla_device in a replica.
ROW_SUMS = """
import sys, torch, torch_xla.runtime as xr
from utils.xla_runtime import choose_device, init_xla_device
choose_device()
xr.initialize_cache(sys.argv[1], readonly=False)
assert xr.global_runtime_device_count() >= 1
x = torch.rand(4, 512).to(init_xla_device())
(x * x).sum(-1).cpu()
"""


def compiled_reductions(tmp_path, xla_flags: str) -> str:
    """The optimized HLO XLA:CPU compiled for a row sum over 512 elements, in a fresh process
    whose XLA_FLAGS are `xla_flags` plus a dump (choose_device adds our defaults)."""
    dump = tmp_path / "dump"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "XLA_FLAGS": f"{xla_flags} --xla_dump_to={dump} --xla_dump_hlo_as_text"}
    done = subprocess.run([sys.executable, "-c", ROW_SUMS, str(tmp_path / "cache")], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    (hlo,) = dump.glob("*cpu_after_optimizations.txt")
    return hlo.read_text()


def test_on_xla_cpu_a_long_reduction_is_one_fused_kernel_unless_the_user_says_otherwise(tmp_path):
    """choose_device turns XLA:CPU's tree reduction rewriter off (it splits a reduction into a
    reduce-window and a reduce, compiled unfused at every occurrence), in time for a runtime
    started before init_xla_device; a user's own
    xla_disable_hlo_passes wins, and with the pass left on, the same sum is split (so the HLO
    read here does show the split when it happens)."""
    from utils.xla_runtime import with_compiler_defaults

    assert with_compiler_defaults("", "TPU") == ""
    assert with_compiler_defaults("--xla_dump_to=/d", "cpu") == (
        "--xla_dump_to=/d --xla_disable_hlo_passes=tree_reduction_rewriter")
    ours = compiled_reductions(tmp_path / "ours", "")
    assert "reduce-window" not in ours and " reduce(" in ours
    assert "reduce-window" in compiled_reductions(tmp_path / "theirs", "--xla_disable_hlo_passes=none")
