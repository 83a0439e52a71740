"""A step traced once and replayed (step_capture.py), with its micro-batches in one XLA loop
(micro_batch_loop.py), against the step traced every time and against eager PyTorch."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_causal_lm
from tolerances import assert_equal_in_exact_arithmetic

from finetuning_pipeline.runtime.xla.micro_batch_loop import summed_over_micro_batches
from finetuning_pipeline.runtime.xla.step_capture import CapturedStep
from finetuning_pipeline.train.step import micro_batch_gradients
from lora_logic.adapters import lora_modules, lora_parameters
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora


@pytest.mark.heavy
def test_lora_dropout_gradients_equal_eager_pytorch_with_the_same_masks():
    """The looped micro-batches' gradients with LoRA dropout 0.3 equal eager CPU autograd with
    the same seeds (the masks are a function of the seed: lora_logic/dropout.py), and equal the
    micro-batches traced one by one; other seeds give other gradients. XLA's loop, its traced
    graphs and eager CPU kernels sum in other orders: float64 (tests/tolerances.py)."""
    import torch_xla

    from finetuning_pipeline.runtime.xla.device import init_xla_device

    device = init_xla_device()
    base = tiny_causal_lm("mistral").to(torch.float64)
    inject_lora(base, LoraConfig(r=4, alpha=8, dropout=0.3))
    with torch.no_grad():
        for _, m in lora_modules(base):
            m.lora_B["default"].weight.normal_(generator=torch.Generator().manual_seed(1))
    cpu_state = {k: v.clone() for k, v in base.state_dict().items()}
    model = base.to(device).train()
    generator = torch.Generator().manual_seed(0)
    batches = []
    for seed in (11, 222, 3333):
        ids = torch.randint(0, 128, (2, 16), generator=generator, dtype=torch.int32)
        batches.append({"input_ids": ids, "labels": ids.clone(), "lora_seed": torch.tensor([seed], dtype=torch.int32)})
    device_batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
    params = lora_parameters(model)
    flat = Flat(params)
    torch_xla.sync()

    looped = summed_over_micro_batches(lambda b: micro_batch_gradients(model, flat, b, packed=False),
                                       device_batches, torch.arange(3).to(device),
                                       reads=list(model.parameters()) + list(model.buffers()))
    torch_xla.sync()
    looped_grad = looped[0].cpu()
    traced = [micro_batch_gradients(model, flat, b, packed=False)[0] for b in device_batches]
    torch_xla.sync()
    assert looped_grad.dtype == torch.float64
    assert_equal_in_exact_arithmetic(looped_grad, sum(g.cpu() for g in traced), "looped against traced")

    def eager_gradient(seeds):
        eager = tiny_causal_lm("mistral").to(torch.float64)
        inject_lora(eager, LoraConfig(r=4, alpha=8, dropout=0.3))
        eager.load_state_dict(cpu_state)
        eager.train()
        eager_params = lora_parameters(eager)
        for batch, seed in zip(batches, seeds):
            micro_batch_gradients(eager, Flat(eager_params, keep=True), {**batch, "lora_seed": torch.tensor([seed])},
                                  packed=False)
        return torch.cat([q.grad.reshape(-1) for q in eager_params])

    assert_equal_in_exact_arithmetic(looped_grad, eager_gradient([11, 222, 3333]), "looped against eager")
    other_masks = eager_gradient([12, 223, 3334])
    assert ((looped_grad - other_masks).norm() / other_masks.norm()).item() > 1e-2


class Flat:
    """What micro_batch_gradients needs of an optimizer; keep=True leaves the .grads to sum."""

    group_count = 1  # one adapter

    def __init__(self, params, keep: bool = False):
        self.params, self.keep = params, keep

    def flat_grad(self):
        return torch.cat([q.grad.reshape(-1) for q in self.params])

    def zero_grad(self):
        if not self.keep:
            for q in self.params:
                q.grad = None


def captured_gradients(grad_accum: int) -> CapturedStep:
    from finetuning_pipeline.runtime.xla.device import init_xla_device

    device = init_xla_device()
    model = tiny_causal_lm("mistral")
    inject_lora(model, LoraConfig(r=4, alpha=8))
    model.to(device).train()
    flat = Flat(lora_parameters(model))

    def gradients(inputs):
        micro_batches = [{"input_ids": t, "labels": t} for t in inputs[:-1]]
        grad, loss, tokens = summed_over_micro_batches(
            lambda b: micro_batch_gradients(model, flat, b, packed=False), micro_batches, inputs[-1],
            reads=list(model.parameters()) + list(model.buffers()))
        return {"grad": grad, "loss": loss}

    step = CapturedStep(gradients, lambda: list(model.parameters()) + list(model.buffers()))
    examples = [torch.randint(0, 128, (2, 16), dtype=torch.int32) for _ in range(grad_accum)]
    step.capture([t.to(device) for t in examples + [torch.arange(grad_accum)]])
    return step


def test_the_compiled_step_holds_one_micro_batch_whatever_grad_accum():
    """The captured computation of 1 and of 4 micro-batches has the same matrix products: one
    micro-batch's, in a While loop (the compiler sees one micro-batch, not k copies)."""
    import torch_xla.core.xla_builder as xb

    def products(grad_accum):
        text = xb.get_computation_hlo(captured_gradients(grad_accum).computation)
        assert " while(" in text
        return sum(" dot(" in line for line in text.splitlines())

    one, four = products(1), products(4)
    assert one > 0 and one == four


def test_a_captured_step_updates_its_state_for_every_view_and_refuses_another_shape():
    import torch_xla

    from finetuning_pipeline.runtime.xla.device import init_xla_device

    device = init_xla_device()
    weight = torch.zeros(4).to(device)
    torch_xla.sync()

    def step(inputs):
        (delta,) = inputs
        weight.add_(delta)
        return {"total": weight.sum()}

    captured = CapturedStep(step, lambda: [weight])
    view = weight.detach()
    for k in range(1, 4):
        results = captured([torch.full((4,), float(k)).to(device)])
        torch_xla.sync()
        expected = float(sum(range(1, k + 1)))
        assert results["total"].item() == 4 * expected
        assert weight.cpu().tolist() == [expected] * 4 and view.cpu().tolist() == [expected] * 4
    with pytest.raises(ValueError, match="a captured step replays one shape"):
        captured([torch.ones(5).to(device)])


def test_inputs_that_share_device_data_are_refused():
    """torch_xla gives equal 0-dim tensors one device data: two such inputs would both be bound
    to the first at every replay (the old capture replayed 1 * 3 + 5 as 20). Refused, naming
    the fix; [1]-shaped inputs of equal value capture and replay right."""
    import torch_xla

    from finetuning_pipeline.runtime.xla.device import init_xla_device

    device = init_xla_device()
    torch_xla.sync()
    shared = CapturedStep(lambda inputs: {"out": inputs[0] * 3 + inputs[1]}, lambda: [])
    with pytest.raises(RuntimeError, match=r"share one device data.*\[1\]-shaped"):
        shared([torch.tensor(2.0, device=device), torch.tensor(2.0, device=device)])

    distinct = CapturedStep(lambda inputs: {"out": inputs[0] * 3 + inputs[1]}, lambda: [])
    first = [torch.tensor([2.0]).to(device), torch.tensor([2.0]).to(device)]
    torch_xla.sync()
    assert distinct(first)["out"].item() == 8.0
    assert distinct([torch.tensor([1.0]).to(device), torch.tensor([5.0]).to(device)])["out"].item() == 8.0


def test_random_numbers_a_replay_would_repeat_are_refused():
    """A draw outside the micro-batch loop would be the same at every replay; a draw inside a
    recomputed (checkpointed) layer brings seed nodes torch_xla does not report. Both refused."""
    import torch_xla
    from torch_xla.utils.checkpoint import checkpoint

    from finetuning_pipeline.runtime.xla.device import init_xla_device

    device = init_xla_device()
    weight = torch.ones(4).to(device)
    torch_xla.sync()
    outside = CapturedStep(lambda inputs: {"noisy": inputs[0] + torch.rand(4, device=device)}, lambda: [weight])
    with pytest.raises(RuntimeError, match="draws torch random numbers outside the micro-batch loop"):
        outside([torch.ones(4).to(device)])

    scale = torch.nn.Parameter(torch.ones(4).to(device))
    torch_xla.sync()

    def body(batch):
        noise = torch.rand(4, device=device)  # a draw first: the layer's saved RNG state is a new seed value
        out = noise.sum() + checkpoint(
            lambda h: torch.nn.functional.dropout(h, 0.5, True) * h, batch["x"] * scale, use_reentrant=True
        )
        out.sum().backward()
        grad, scale.grad = scale.grad, None
        return [grad, out.detach()]  # the forward's seed and the recomputation's restored one

    batches = [{"x": torch.ones(4).to(device)} for _ in range(2)]
    torch_xla.sync()
    with pytest.raises(RuntimeError, match="set train.capture_step=false"):
        summed_over_micro_batches(body, batches, torch.arange(2).to(device), reads=[scale])


def test_model_dropouts_finds_every_familys_names():
    from transformers import Gemma3Config, MistralConfig, Phi3Config

    from finetuning_pipeline.runtime.xla.scan_choice import model_dropouts

    assert model_dropouts(Phi3Config(resid_pdrop=0.1, attention_dropout=0.2)) == {"resid_pdrop": 0.1,
                                                                                  "attention_dropout": 0.2}
    assert model_dropouts(Gemma3Config(text_config={"attention_dropout": 0.1})) == {
        "text_config.attention_dropout": 0.1
    }
    assert model_dropouts(MistralConfig()) == {}
