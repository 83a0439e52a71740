"""Decoder layers run as one XLA loop (finetuning_pipeline/runtime/xla/layer_scan.py) compute what the model's own
layer loop computes: loss, LoRA gradients (per layer, under the unscanned names), LoRA dropout
masks per layer, sliding windows, and a captured training step over 2 micro-batches; the
adapter saved from a scanned model on the device is the one a plain model loads; layers that
differ, and adapters loaded into scanned layers, are refused."""

from __future__ import annotations

import pytest
import torch
import torch_xla
from test_model_families import FAMILIES, batch, family_model
from tolerances import assert_equal_in_exact_arithmetic

from finetuning_pipeline.model.causal_lm_loss import causal_lm_loss_sum
from finetuning_pipeline.runtime.xla.layer_scan import ScannedLayers, scan_decoder_layers
from lora_logic.adapters import lora_parameters, lora_state_dict
from lora_logic.config import LoraConfig
from lora_logic.dropout import set_dropout_seed
from lora_logic.inject import inject_lora
from lora_logic.layer import LoRALinear
from utils.precision import float64_throughout


def deeper(name: str, layers: int = 4, dropout: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The family's tiny model with `layers` identical layers and LoRA dropout. Mistral and
    Gemma 3 keep their sliding window (6, shorter than the batch's rows; Gemma 3 all layers
    sliding, with its local rotary table); Qwen3's window is only on some layers
    (max_window_layers), which would make them differ, so it is off."""
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    config = FAMILIES[name]()
    config.num_hidden_layers = layers
    if name == "gemma3":
        config.layer_types = ["sliding_attention"] * layers
    elif name == "qwen3":
        config.use_sliding_window, config.sliding_window = False, None
        config.layer_types = ["full_attention"] * layers
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    inject_lora(model, LoraConfig(r=4, alpha=8, dropout=dropout))
    with torch.no_grad():
        for param in lora_parameters(model):
            param.normal_(std=0.05)
    return model.train()


def loss_and_lora_grads(model, data: dict) -> tuple[float, dict[str, torch.Tensor]]:
    device = torch_xla.device()
    model.to(device)
    set_dropout_seed(model, torch.tensor([11], dtype=torch.int32, device=device))
    with float64_throughout(model.dtype):
        loss_sum, count = causal_lm_loss_sum(model, {k: v.to(device) for k, v in data.items()}, packed=True)
        (loss_sum / count).backward()
    set_dropout_seed(model, None)
    grads = {}
    for name, module in model.named_modules():
        if isinstance(module, ScannedLayers):
            for layer_name, stack in module.stacked_lora_parameters():
                for i in range(module.count):
                    grads[f"{name}.{i}.{layer_name}"] = stack.grad[i]
        elif isinstance(module, LoRALinear):
            grads.update({f"{name}.{n}": p.grad for n, p in module.named_parameters() if p.requires_grad})
    torch_xla.sync()
    return (loss_sum / count).item(), {k: v.cpu() for k, v in grads.items()}


@pytest.mark.heavy
@pytest.mark.parametrize("family", ["mistral", "llama", "qwen3", "gemma3"])  # mistral, gemma3: sliding
def test_scanned_layers_give_the_loss_and_gradients_of_the_layer_loop(family):
    """XLA's loop and the unrolled layers sum in other orders: float64 (tests/tolerances.py)."""
    data = batch(packed=True)
    expected_loss, expected = loss_and_lora_grads(deeper(family, dropout=0.1, dtype=torch.float64), data)
    model = deeper(family, dropout=0.1, dtype=torch.float64)
    scan_decoder_layers(model)
    loss, grads = loss_and_lora_grads(model, data)
    assert_equal_in_exact_arithmetic(loss, expected_loss, "loss")
    assert grads.keys() == expected.keys() and len(grads) == 4 * 2 * len(LoraConfig().target_modules)
    for key, grad in expected.items():
        assert grad.dtype == torch.float64 and grad.abs().max() > 0, key
        assert_equal_in_exact_arithmetic(grads[key], grad, key)
    # Dropout masks differ per layer: with one salt for all layers the gradients would not match.
    assert len(lora_parameters(model)) == 2 * len(LoraConfig().target_modules)


@pytest.mark.heavy
def test_a_captured_step_over_two_micro_batches_gives_the_layer_loop_losses():
    """The trainer's captured step (micro-batch loop around the layer loop), 4 steps, LoRA dropout."""
    from finetuning_pipeline.distributed.parallel import Parallel
    from finetuning_pipeline.run_config import load_config
    from finetuning_pipeline.runtime.xla.runtime import XlaRuntime
    from finetuning_pipeline.train.adamw import MaskedAdamW
    from finetuning_pipeline.train.stepper import Stepper

    config = load_config(None, ["model.path=unused", "model.dtype=float64", "lora.dropout=0.1", "train.grad_accum=2",
                                "train.micro_batch=1", "train.max_steps=4"])
    device = torch_xla.device()
    runs = []
    for scan in (False, True):
        model = deeper("mistral", dropout=0.1, dtype=torch.float64)  # other sums: float64 (tests/tolerances.py)
        if scan:
            scan_decoder_layers(model)
        model.to(device)
        stepper = Stepper(model, MaskedAdamW(lora_parameters(model), lr=1e-2), config.train, phase=1,
                          lr=config.lr(1), max_steps=config.max_steps(1), activation_checkpointing=False,
                          parallel=Parallel("dp"), device=device, start_step=0, packed=True,
                          runtime=XlaRuntime())
        micro_batches = []
        for i in range(2):  # each sequence with its dropout seed, as the phase's data gives them
            rows = batch(packed=True)
            seeds = (torch.arange(rows["input_ids"].shape[0]) + 100 * i).reshape(-1, 1).to(torch.int32)
            micro_batches.append({k: v.to(device) for k, v in {**rows, "lora_seed": seeds}.items()})
        losses = []
        for step in range(4):
            results = stepper(step, micro_batches)
            torch_xla.sync()
            losses.append(results["loss"].item())
        runs.append(losses)
    assert stepper.execution.gradients.captured
    assert len(set(runs[0])) == 4
    assert_equal_in_exact_arithmetic(runs[1], runs[0], "losses")


@pytest.mark.heavy
def test_the_layer_is_traced_once_per_setting_and_replayed_for_later_batches(monkeypatch):
    """A traced layer (AOTAutograd, forward and backward: seconds of host time on a real model)
    is reused for every later call of the same shapes and settings: evaluation batch after
    evaluation batch. Anything the shapes do not show traces anew, with its own values: train
    against eval (the dropout's masks), a module's setting, an adapter frozen. Each evaluation
    equals the model's own layer loop, in float64."""
    import torch_xla.experimental.scan as xla_scan

    from finetuning_pipeline.runtime.xla import layer_scan

    traces, bodies = [], []  # AOTAutograd's traces (each calls its body more than once); the bodies
    aot_function, call = xla_scan.aot_function, layer_scan._LayerBody.__call__
    monkeypatch.setattr(xla_scan, "aot_function", lambda *a, **k: traces.append(1) or aot_function(*a, **k))

    def noted(body, h, xs):
        if body not in bodies:
            bodies.append(body)
        return call(body, h, xs)

    monkeypatch.setattr(layer_scan._LayerBody, "__call__", noted)
    device = torch_xla.device()
    reference = deeper("mistral", dropout=0.1, dtype=torch.float64).to(device).eval()
    model = deeper("mistral", dropout=0.1, dtype=torch.float64)
    scan_decoder_layers(model)
    model.to(device).eval()

    def losses(*models, seed=0) -> list[float]:
        rows = batch(packed=True)
        shape = rows["input_ids"].shape
        rows["input_ids"] = torch.randint(3, 100, shape, generator=torch.Generator().manual_seed(seed))
        rows["labels"] = rows["input_ids"].clone()
        out = []
        for m in models:
            with torch.no_grad(), float64_throughout(torch.float64):
                total, count = causal_lm_loss_sum(m, {k: v.to(device) for k, v in rows.items()}, packed=True)
            out.append((total / count).item())
        return out

    for seed in range(3):  # three evaluation batches, one trace
        ours, theirs = losses(model, reference, seed=seed)
        assert_equal_in_exact_arithmetic(ours, theirs, f"batch {seed}")
    assert len(traces) == 1 and len(bodies) == 1
    model.train()  # training: dropout live, its seeds and salts loop inputs
    set_dropout_seed(model, torch.tensor([11], dtype=torch.int32, device=device))
    losses(model)
    losses(model, seed=1)
    set_dropout_seed(model, None)
    assert len(traces) == 2 and len(bodies) == 2
    model.eval()
    losses(model, seed=3)
    assert len(traces) == 2  # eval again: the first trace
    scanned = model.get_decoder().layers
    scanned.template.self_attn.scaling *= 2  # a setting of a module: a new trace that uses it
    for layer in reference.model.layers:
        layer.self_attn.scaling *= 2
    ours, theirs = losses(model, reference, seed=4)
    assert len(traces) == 3 and len(bodies) == 3
    assert_equal_in_exact_arithmetic(ours, theirs, "the changed setting")
    for _, stack in scanned.stacked_lora_parameters():  # frozen: no gradient to trace for them
        stack.requires_grad_(False)
    losses(model, seed=5)
    assert len(traces) == 4 and len(bodies) == 4


def test_the_adapter_names_and_values_are_the_unscanned_ones():
    expected = {k: v.clone() for k, v in lora_state_dict(deeper("mistral")).items()}
    model = deeper("mistral")
    scan_decoder_layers(model)
    state = lora_state_dict(model)
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_optimizer_moments_convert_between_stacks_and_the_unscanned_layout():
    """What a checkpoint stores: one tensor per LoRA weight of the unscanned model, in its
    lora_parameters order, whether the layers ran scanned or not (4 layers x 7 targets x A/B)."""
    from lora_logic.adapters import per_layer_lora, stacked_lora

    plain = deeper("mistral")
    scanned = deeper("mistral")
    scan_decoder_layers(scanned)
    unscanned_layout, stacks = lora_parameters(plain), lora_parameters(scanned)
    assert len(unscanned_layout) == 4 * 7 * 2 and len(stacks) == 7 * 2
    per_layer = per_layer_lora(scanned, stacks)
    assert len(per_layer) == len(unscanned_layout)
    for ours, theirs in zip(per_layer, unscanned_layout):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(stacked_lora(scanned, unscanned_layout), stacks):
        assert torch.equal(ours, theirs)
    assert per_layer_lora(plain, unscanned_layout) == unscanned_layout == stacked_lora(plain, unscanned_layout)
    with pytest.raises(ValueError, match="tensors for the model's"):
        stacked_lora(scanned, unscanned_layout[:-1])


def test_the_adapter_saved_from_scanned_layers_on_the_device_loads_into_a_plain_model(tmp_path):
    """The hard case of saving: stacks on the XLA device, read on the host one stack at a time
    (no graph compiled), written in PEFT's layout, loaded by a model that was never scanned."""
    from finetuning_pipeline.runtime.xla.counters import read_counters
    from lora_logic.adapter_io import load_adapters, save_adapters

    model = deeper("mistral")
    scan_decoder_layers(model)
    model.to(torch_xla.device())
    torch_xla.sync()
    before = read_counters()
    save_adapters(model, tmp_path / "adapter", LoraConfig(r=4, alpha=8), "tiny")
    assert (read_counters() - before).compiles == 0
    plain = deeper("mistral")
    with torch.no_grad():
        for param in lora_parameters(plain):
            param.zero_()
    load_adapters(plain, tmp_path / "adapter")
    expected = lora_state_dict(model)
    for key, value in lora_state_dict(plain).items():
        assert torch.equal(value, expected[key]), key


def test_adapters_are_loaded_before_scanning_not_into_the_stacks(tmp_path):
    from lora_logic.adapter_io import load_adapters, save_adapters
    from lora_logic.merge import merge_lora

    save_adapters(deeper("mistral"), tmp_path / "adapter", LoraConfig(r=4, alpha=8), "tiny")
    model = deeper("mistral")
    scan_decoder_layers(model)
    for refused in (lambda: load_adapters(model, tmp_path / "adapter"), lambda: merge_lora(model),
                    lambda: inject_lora(model, LoraConfig(r=4, alpha=8))):
        with pytest.raises(ValueError, match="decoder layers are scanned.*before scan_decoder_layers"):
            refused()


def test_layers_that_differ_are_refused_naming_the_setting():
    model = family_model("gemma3")  # a sliding layer, then a full one
    with pytest.raises(ValueError, match=r"decoder layers 0 and 1 differ in .*sliding"):
        scan_decoder_layers(model)


def test_a_model_that_changes_the_hidden_states_between_layers_is_refused():
    model = deeper("mistral")
    scanned = scan_decoder_layers(model)
    hidden = torch.zeros(1, 4, 32)
    calls = scanned[:]
    calls[0](hidden)
    with pytest.raises(RuntimeError, match="changed the hidden states between two layers"):
        calls[1](hidden + 1)


def test_the_trainer_scans_where_the_model_allows_and_says_why_not_elsewhere():
    """train.scan_layers: unset scans where it can and the depth pays, and names the reason
    where not; true makes the reason an error naming the key; false never scans."""
    from finetuning_pipeline.errors import ConfigError
    from finetuning_pipeline.runtime.xla.scan_choice import scan_layers

    def has_scan(model):
        return any(isinstance(m, ScannedLayers) for m in model.modules())

    model = deeper("mistral", layers=16)
    assert scan_layers(model, None, activation_checkpointing=True, spmd=False).startswith(
        "decoder layers scanned: 16 layers"
    )
    assert has_scan(model) and model.get_decoder().layers.activation_checkpointing
    model = deeper("mistral")  # 4 layers: too few to pay unless asked for
    assert "4 layers compile about as fast unrolled" in scan_layers(
        model, None, activation_checkpointing=False, spmd=False
    )
    assert not has_scan(model)
    assert scan_layers(model, True, activation_checkpointing=False, spmd=False).startswith(
        "decoder layers scanned: 4 layers"
    )
    for setting in (None, True, False):
        model = family_model("gemma3")  # a sliding layer, then a full one
        if setting:
            with pytest.raises(
                ConfigError, match=r"train.scan_layers=true, but decoder layers 0 and 1 differ in .*sliding"
            ):
                scan_layers(model, setting, activation_checkpointing=False, spmd=False)
        else:
            message = scan_layers(model, setting, activation_checkpointing=False, spmd=False)
            assert message.startswith("decoder layers run one by one") and ("sliding" in message) == (setting is None)
        assert not has_scan(model)
    model = deeper("mistral")
    model.config.attention_dropout = 0.1
    assert "attention_dropout 0.1" in scan_layers(
        model, None, activation_checkpointing=False, spmd=False
    ) and not has_scan(model)
    model = deeper("mistral")
    assert "parallel.mode=fsdp" in scan_layers(model, None, activation_checkpointing=False, spmd=True) and not has_scan(
        model
    )
