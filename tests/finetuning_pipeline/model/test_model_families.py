"""Each model family trained exactly as transformers defines it: our loss (explicit masks per
layer type, plain and packed, full or chunked logits) against transformers' own loss with its
own masks, loss and LoRA gradients: in float64, held to 1e-10, where the claim is "equal in
exact arithmetic" (tests/tolerances.py), on the host and on the XLA device.

transformers' reference gets no mask at all: for plain rows it builds its causal (and sliding
window) masks itself, and for packed rows it detects the samples from the restarting
`position_ids`. Every family with a sliding window gets one smaller than the sequence, so a
mask that dropped the window would fail (checked: test_a_single_full_mask_would_be_wrong).
"""

from __future__ import annotations

import pytest
import torch
from model_families import FAMILIES, LENGTH, SLIDING, VOCAB, batch, family_model, reference_kernel, reference_splash_ops
from tolerances import assert_equal_in_exact_arithmetic
from transformers import AutoModelForCausalLM

from finetuning_pipeline.model.attention_masks import mask_windows
from finetuning_pipeline.model.causal_lm_loss import CHUNKED_MODEL_TYPES, causal_lm_loss_sum
from lora_logic.adapters import lora_modules, lora_parameters
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora
from utils.precision import float64_throughout


def reference_loss(model, data: dict, packed: bool) -> torch.Tensor:
    """transformers' own: no mask, its own loss (mean over label tokens)."""
    kwargs = {"position_ids": data["position_ids"]} if packed else {}
    return model(input_ids=data["input_ids"], labels=data["labels"], use_cache=False, **kwargs).loss


def ours(model, data: dict, packed: bool, loss_chunk: int = 0) -> torch.Tensor:
    loss_sum, count = causal_lm_loss_sum(model, data, packed=packed, loss_chunk=loss_chunk)
    return loss_sum / count


def assert_same_loss_and_grads(actual, expected) -> None:
    """(loss, LoRA gradients) pairs of float64 models, equal within float64's bound."""
    (loss, grads), (expected_loss, expected_grads) = actual, expected
    assert loss.dtype == torch.float64 and len(grads) == len(expected_grads) > 0
    assert_equal_in_exact_arithmetic(loss, expected_loss, "loss")
    for index, (grad, expected_grad) in enumerate(zip(grads, expected_grads)):
        assert_equal_in_exact_arithmetic(grad, expected_grad, f"LoRA gradient {index}")


def loss_and_grads(model, compute) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with float64_throughout(model.dtype):  # (a float64 model: its fp32 islands too, as the trainer does)
        loss = compute()
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in lora_parameters(model)]


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_our_loss_and_lora_gradients_equal_transformers(family, packed):
    model = family_model(family, torch.float64)
    data = batch(packed)
    expected, expected_grads = loss_and_grads(model, lambda: reference_loss(model, data, packed))
    loss, grads = loss_and_grads(model, lambda: ours(model, data, packed))
    assert_same_loss_and_grads((loss, grads), (expected, expected_grads))


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_chunked_loss_equals_the_full_logits(family, packed):
    """7 tokens a chunk: nine full chunks and a ragged one over 2 x 32 tokens."""
    model = family_model(family, torch.float64)
    assert model.config.model_type in CHUNKED_MODEL_TYPES
    data = batch(packed)
    expected, expected_grads = loss_and_grads(model, lambda: ours(model, data, packed))
    loss, grads = loss_and_grads(model, lambda: ours(model, data, packed, loss_chunk=7))
    assert_same_loss_and_grads((loss, grads), (expected, expected_grads))


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_a_single_full_mask_would_be_wrong(family):
    """The failure these tests guard against: one full causal mask for every layer (what the
    trainer passed before) trains another loss than the family's own whenever window < seq_len."""
    model = family_model(family)
    data = batch(packed=False)
    assert any(window for window in mask_windows(model.config).values())
    full = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], attention_mask=full, use_cache=False).logits
        single_mask = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), data["labels"][:, 1:].reshape(-1)
        )
        assert abs(single_mask.item() - reference_loss(model, data, False).item()) > 1e-4


def test_the_gemma2_reference_really_soft_caps():
    """Soft-capping on: the final logits of the tiny Gemma 2 stay inside +-3."""
    model = family_model("gemma2")
    with torch.no_grad():
        logits = model(input_ids=batch(False)["input_ids"], use_cache=False).logits
    assert logits.abs().max().item() <= 3.0


def test_masks_on_xla_cost_no_host_sync_and_no_new_graph():
    """A packed Gemma 3 forward+backward with its per-layer-type masks and the chunked loss, twice
    on the XLA device: the second call compiles nothing and no call reads a value on the host."""
    import torch_xla

    from finetuning_pipeline.runtime.xla.counters import read_counters
    from finetuning_pipeline.runtime.xla.device import init_xla_device

    device = init_xla_device()
    model = family_model("gemma3", torch.float64)
    expected, expected_grads = loss_and_grads(model, lambda: ours(model, batch(packed=True), True))  # CPU, full logits
    model.zero_grad(set_to_none=True)  # the reference's gradients must not ride along to the device
    model.to(device)
    data = {k: v.to(torch.int32).to(device) for k, v in batch(packed=True).items()}
    deltas = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)  # as the trainer: every step starts without gradients
        before = read_counters()
        with float64_throughout(model.dtype):
            loss_sum, _ = causal_lm_loss_sum(model, data, packed=True, loss_chunk=16)
            loss_sum.backward()
        torch_xla.sync()
        deltas.append(read_counters() - before)
    assert deltas[1].compiles == 0
    assert deltas[0].host_syncs == 0 and deltas[1].host_syncs == 0
    # torch_xla's checkpoint recomputes each chunk: the same loss and gradients as the full path,
    # in exact arithmetic (XLA sums in other orders than the CPU's kernels).
    count = (batch(packed=True)["labels"][:, 1:] != -100).sum()
    assert_equal_in_exact_arithmetic(loss_sum.cpu() / count, expected, "loss on the device")
    for index, (param, reference_grad) in enumerate(zip(lora_parameters(model), expected_grads)):
        assert_equal_in_exact_arithmetic(param.grad.cpu() / count, reference_grad, f"LoRA gradient {index}")


def test_the_hand_written_backward_matches_autograd_for_every_logit_processing():
    """LinearCrossEntropy's gradient against autograd through the same processing: scaling
    (Cohere), dividing (Granite) and soft-capping (Gemma), all at once, with ignored targets."""
    from finetuning_pipeline.model.causal_lm_loss import LinearCrossEntropy, process_logits

    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 5, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 40, (3, 5), generator=generator)
    targets[0, :2] = -100
    processing = (1.7, 2.5, 4.0)  # scale, divide, softcap
    LinearCrossEntropy.apply(hidden, weight, targets, processing).backward()
    ours = hidden.grad.clone()
    hidden.grad = None
    logits = process_logits(hidden.reshape(-1, 16) @ weight.t(), *processing)
    torch.nn.functional.cross_entropy(logits, targets.reshape(-1), ignore_index=-100, reduction="sum").backward()
    assert ours.dtype == torch.float64
    assert_equal_in_exact_arithmetic(ours, hidden.grad, "the hand-written gradient")


def test_a_lora_wrapped_lm_head_takes_checkpointed_chunks_with_the_same_loss():
    model = AutoModelForCausalLM.from_config(FAMILIES["llama"]()).double()
    torch.manual_seed(0)
    inject_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "lm_head"]))
    with torch.no_grad():
        for _, module in lora_modules(model):
            module.lora_B["default"].weight.normal_(std=0.05)
    data = batch(packed=False)
    expected, expected_grads = loss_and_grads(model, lambda: ours(model, data, False))
    loss, grads = loss_and_grads(model, lambda: ours(model, data, False, loss_chunk=7))
    assert_same_loss_and_grads((loss, grads), (expected, expected_grads))


@pytest.mark.parametrize("trained", ["modules_to_save", "trainable_token_indices"])
def test_an_output_layer_trained_beside_the_lora_makes_its_weight_once_for_all_chunks(trained, monkeypatch):
    """The output layer trained whole or by rows (lora_logic/modules_to_save.py, trainable_tokens.py)
    under the chunked loss: the loss and every gradient (the LoRA's, the copies' or rows') as with
    the full logits, and its weight made once for the 5 chunks, not once a chunk."""
    from lora_logic.adapters import named_lora_parameters
    from lora_logic.modules_to_save import ModuleAdapter

    model = AutoModelForCausalLM.from_config(FAMILIES["llama"]()).double()
    torch.manual_seed(0)
    setting = ({"modules_to_save": ["embed_tokens", "lm_head"]} if trained == "modules_to_save"
               else {"trainable_token_indices": {"embed_tokens": [3, 9], "lm_head": [3, 9, 40]}})
    inject_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj"], **setting))
    with torch.no_grad():
        for name, parameter in named_lora_parameters(model):
            if "lora_A" not in name:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    data = batch(packed=False)
    expected, expected_grads = loss_and_grads(model, lambda: ours(model, data, False))
    made = []
    real = ModuleAdapter.weights_now
    monkeypatch.setattr(ModuleAdapter, "weights_now", lambda self: made.append(self) or real(self))
    loss, grads = loss_and_grads(model, lambda: ours(model, data, False, loss_chunk=13))  # 64 tokens: 5 chunks
    assert made.count(model.get_output_embeddings()) == 1
    assert len(grads) == len(named_lora_parameters(model)) == len(expected_grads)
    assert_same_loss_and_grads((loss, grads), (expected, expected_grads))


# -- Pallas kernels' inputs, checked on a CPU through a reference of their semantics --------
def flash_covers(family: str) -> bool:
    """flash attention has no window and no soft-cap: only such families can take it."""
    config = FAMILIES[family]()
    return not any(mask_windows(config).values()) and not getattr(config, "attn_logit_softcapping", None)


KERNEL_CASES = [(family, kind) for family in FAMILIES for kind in ("splash", "flash")
                if kind == "splash" or flash_covers(family)]


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("family, kind", KERNEL_CASES)
def test_kernel_inputs_give_the_dense_loss_and_gradients(family, kind, packed, monkeypatch):
    """The model's layers call our kernel attention function with the inputs splash / flash
    would get; a reference of each kernel's semantics must then reproduce the dense path."""
    from finetuning_pipeline.runtime.xla import kernel_attention

    model = family_model(family, torch.float64)
    model.set_attn_implementation("eager")  # the dense reference: exact, soft-capping included
    data = batch(packed)
    expected, expected_grads = loss_and_grads(model, lambda: ours(model, data, packed))
    if kind == "splash":  # through our autograd Function, with torch_xla's ops replaced by the reference
        monkeypatch.setattr(kernel_attention, "splash_ops", reference_splash_ops)
    else:
        monkeypatch.setitem(kernel_attention.KERNELS, kind, reference_kernel(kind))
    kernel_attention.enable_kernel_attention(model, kind)
    loss, grads = loss_and_grads(model, lambda: ours(model, data, packed, loss_chunk=7))
    assert_same_loss_and_grads((loss, grads), (expected, expected_grads))


@pytest.mark.heavy
@pytest.mark.parametrize("family", sorted(SLIDING))
def test_the_captured_step_gives_transformers_gradients(family):
    """The trainer's captured gradients (step_capture + the micro-batch loop) on every
    sliding-window family: the packed batch as 2 micro-batches of one row, each packed row its
    own mask per layer type, the chunked loss in 7-token chunks; traced once, replayed twice.
    Summed gradients / label tokens equal transformers' gradients of its mean loss on the CPU."""
    import torch_xla

    from finetuning_pipeline.runtime.xla.counters import read_counters
    from finetuning_pipeline.runtime.xla.device import init_xla_device
    from finetuning_pipeline.runtime.xla.micro_batch_loop import summed_over_micro_batches
    from finetuning_pipeline.runtime.xla.step_capture import CapturedStep
    from finetuning_pipeline.train.step import micro_batch_gradients

    device = init_xla_device()
    model = family_model(family, torch.float64)
    data = batch(packed=True)
    expected, expected_grads = loss_and_grads(model, lambda: reference_loss(model, data, True))
    model.zero_grad(set_to_none=True)  # the reference's gradients must not ride along to the device
    model.to(device)
    params = lora_parameters(model)

    class Flat:
        group_count = 1  # one adapter

        def flat_grad(self):
            return torch.cat([p.grad.reshape(-1) for p in params])

        def zero_grad(self):
            for p in params:
                p.grad = None

    keys = sorted(data)

    def gradients(inputs):
        micro_batches = [dict(zip(keys, inputs[i:i + len(keys)])) for i in range(0, len(inputs) - 1, len(keys))]
        grad, loss, tokens = summed_over_micro_batches(
            lambda b: micro_batch_gradients(model, Flat(), b, packed=True, loss_chunk=7), micro_batches,
            inputs[-1], reads=list(model.parameters()) + list(model.buffers()))
        return {"grad": grad, "loss": loss, "tokens": tokens}

    step = CapturedStep(gradients, lambda: list(model.parameters()) + list(model.buffers()))
    inputs = [data[k][row:row + 1].to(torch.int32).to(device) for row in range(2) for k in keys]
    inputs.append(torch.tensor([5, 6]).to(device))
    torch_xla.sync()
    for replay in range(3):
        before = read_counters()
        results = step(inputs)
        torch_xla.sync()
        delta = read_counters() - before
        assert delta.host_syncs == 0 and (replay == 0 or delta.compiles == 0)
    captured = [results[k].cpu() for k in ("grad", "loss", "tokens")]
    # The same micro-batches traced one by one on the device: the same numbers, bit for bit.
    traced = [micro_batch_gradients(model, Flat(), dict(zip(keys, inputs[i:i + len(keys)])), packed=True,
                                    loss_chunk=7) for i in (0, len(keys))]
    torch_xla.sync()
    for a, b, c in zip(captured, *traced):
        torch.testing.assert_close(a, b.cpu() + c.cpu(), rtol=0, atol=0)
    grad, loss, tokens = captured
    # Against transformers on the CPU: XLA sums in other orders, so equal in exact arithmetic.
    assert_equal_in_exact_arithmetic(loss / tokens, expected, "loss on the device")
    grads = torch.split(grad / tokens, [p.numel() for p in params])
    for index, (ours_grad, reference_grad) in enumerate(zip(grads, expected_grads)):
        assert_equal_in_exact_arithmetic(ours_grad.view(reference_grad.shape), reference_grad, f"LoRA gradient {index}")
