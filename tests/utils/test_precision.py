"""float64 for the equality proofs: inside float64_throughout a model's fp32 islands (transformers'
RMSNorm casts to fp32 whatever its input; softmax in fp32) stay float64, so two computations
equal in exact arithmetic agree to float64's rounding; other dtypes are left as the model wrote
them; and a TPU refuses model.dtype=float64."""

from __future__ import annotations

import pytest
import torch

from utils.precision import at_least_fp32, float64_throughout, keeping_float64


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm, as MistralRMSNorm writes it."""
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm

    norm = MistralRMSNorm(x.shape[-1]).to(x.dtype)
    return norm(x)


def test_the_fp32_islands_of_a_float64_model_stay_float64_inside():
    torch.manual_seed(0)
    x = torch.randn(4, 64, dtype=torch.float64) * 3
    exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    outside = rms_norm(x)
    assert (outside - exact).abs().max() > 1e-9  # rounded to fp32 on the way
    with float64_throughout(torch.float64):
        inside = rms_norm(x)
        soft = torch.softmax(x, dim=-1, dtype=torch.float32)
        also = x.float()
        # Every spelling of the cast a family may write (an fp32 tensor's dtype taken, by .to or .type_as).
        fp32 = torch.zeros(1)
        spellings = [x.to(fp32), x.to("cpu", torch.float32), x.to(dtype=torch.float32), x.type(torch.float32),
                     x.type("torch.FloatTensor"), x.type(torch.FloatTensor), x.type(dtype=torch.float32),
                     x.type_as(fp32)]
    assert inside.dtype == torch.float64 and (inside - exact).abs().max() < 1e-14
    assert soft.dtype == torch.float64 and also.dtype == torch.float64
    assert [t.dtype for t in spellings] == [torch.float64] * len(spellings)
    assert all(torch.equal(t, x) for t in spellings)
    assert x.to(fp32).dtype == x.type_as(fp32).dtype == x.type(torch.float32).dtype == torch.float32  # outside
    assert keeping_float64(lambda t: t.to(torch.float32))(x).dtype == torch.float64  # (a layer's recompute)
    with float64_throughout(torch.float32):  # other dtypes: the model's own numerics
        assert rms_norm(x.float()).dtype == torch.float32 and x.float().dtype == torch.float32
    assert at_least_fp32(x).dtype == torch.float64 and at_least_fp32(x.bfloat16()).dtype == torch.float32


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_on_the_xla_device_is_float64_inside(approximate):
    """torch_xla 2.9 lowers GELU with fp32 constants: 7e-9 off in float64, outside the context
    (why the context computes it from its formula); inside, forward and backward agree with the
    CPU's float64 GELU to float64's rounding."""
    import torch_xla

    x = torch.linspace(-6, 6, 401, dtype=torch.float64, requires_grad=True)
    expected = torch.nn.functional.gelu(x, approximate=approximate)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    on_device = x.detach().to(torch_xla.device()).requires_grad_(True)
    outside = torch.nn.functional.gelu(on_device, approximate=approximate)
    assert (outside.detach().cpu() - expected.detach()).abs().max() > 1e-10
    with float64_throughout(torch.float64):
        inside = torch.nn.functional.gelu(on_device, approximate=approximate)
        (grad,) = torch.autograd.grad(inside.sum(), on_device)
    assert inside.dtype == torch.float64 and (inside.detach().cpu() - expected.detach()).abs().max() < 1e-14
    assert (grad.cpu() - expected_grad).abs().max() < 1e-14


def test_a_tpu_refuses_float64(monkeypatch, tmp_path, tiny_model_dir, data):
    from trainer_helpers import write_run_config

    from finetuning_pipeline.errors import ConfigError
    from finetuning_pipeline.run_config import load_config
    from finetuning_pipeline.runtime.xla import runtime as xla_runtime

    config = load_config(write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out",
                                          model={"path": str(tiny_model_dir), "dtype": "float64"}), [])
    monkeypatch.setattr(xla_runtime, "device_kind", lambda: "TPU")
    with pytest.raises(ConfigError, match="model.dtype=float64 is for the tests' equality proofs on a CPU"):
        xla_runtime.XlaBackend().launch(config, None, ())
