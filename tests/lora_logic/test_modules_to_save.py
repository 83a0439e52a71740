"""Modules trained in full beside the LoRA (lora.modules_to_save: the embeddings and the output
layer) against PEFT 0.21's `modules_to_save` on the 7 families, tied ones included (Gemma 2 and
3 tie their embeddings): PEFT loads the adapter we save and computes our logits and gradients,
within 1e-10 in float64 and 1e-5 in fp32; we load the adapter PEFT saves; the merged model is the
adapter's; a tied pair is one trained weight; what cannot hold such an adapter says so."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from model_families import FAMILIES, TARGETS
from safetensors.torch import load_file
from tolerances import assert_equal_in_exact_arithmetic
from transformers import AutoModelForCausalLM

from lora_logic.adapter_io import load_adapters, read_adapter_weights, save_adapters
from lora_logic.adapters import lora_modules, named_lora_parameters
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora
from lora_logic.merge import merge_and_unload
from lora_logic.modules_to_save import ModulesToSave, tied_output_layer

peft = pytest.importorskip("peft")
SAVED = ("embed_tokens", "lm_head")  # (PEFT edits the list it is given: a tuple, copied for it)
BOUNDS = {torch.float64: 1e-10, torch.float32: 1e-5}


def base(name: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[name]()).to(dtype)
    model.config.use_cache = False
    return model


def lora_config(name: str, **changes) -> LoraConfig:
    targets = TARGETS.get(name)
    return LoraConfig(r=4, alpha=8, modules_to_save=SAVED, **({"target_modules": targets} if targets else {}),
                      **changes)


def trained(model: torch.nn.Module) -> torch.nn.Module:
    """As after some training: B random, the saved modules' copies moved off the base."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, parameter in named_lora_parameters(model):
            if "lora_A" not in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.05)
    return model


def inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 96, (2, 16), generator=generator)
    return {"input_ids": ids, "labels": ids}


def loss_and_grads(model, prefix: str = "") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and each trainable weight's gradient by its name in our model (PEFT's prefix off)."""
    model.zero_grad()
    out = model(**inputs())
    out.loss.backward()
    grads = {n.removeprefix(prefix): p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "fp32"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_loads_our_adapter_and_computes_our_logits_and_gradients(family, dtype, tmp_path):
    config = lora_config(family)
    ours = base(family, dtype)
    tied = tied_output_layer(ours) is not None
    assert tied == family.startswith("gemma")  # (the hard case is among them)
    inject_lora(ours, config)
    trained(ours)
    save_adapters(ours, tmp_path, config, "tiny")
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["modules_to_save"] == list(SAVED) and saved["ensure_weight_tying"] == tied
    keys = set(load_file(tmp_path / "adapter_model.safetensors"))
    assert {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"} <= keys
    theirs = peft.PeftModel.from_pretrained(base(family, dtype), tmp_path, is_trainable=True)
    logits, grads = loss_and_grads(ours.train())
    their_logits, their_grads = loss_and_grads(theirs.train(), "base_model.model.")
    assert grads.keys() == their_grads.keys() and len(grads) == len(named_lora_parameters(ours))
    assert any("modules_to_save" in n for n in grads)
    assert_equal_in_exact_arithmetic(logits, their_logits, "PEFT's logits", BOUNDS[dtype])
    for name in grads:
        assert_equal_in_exact_arithmetic(grads[name], their_grads[name], f"{name}'s gradient", BOUNDS[dtype])
    # Tied: one trained weight, its gradient from the embedding's use and the output layer's.
    embedding, head = ours.get_input_embeddings(), ours.get_output_embeddings()
    assert (embedding.modules_to_save["default"].weight is head.modules_to_save["default"].weight) == tied


def saved_by_peft(family: str, peft_config, directory) -> torch.nn.Module:
    """PEFT's float64 model of `family` under `peft_config`, its trainable weights moved (B, the
    embeddings' copies or rows) as after training, saved to `directory`; returned in eval mode."""
    theirs = peft.get_peft_model(base(family, torch.float64), peft_config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in theirs.named_parameters():
            if parameter.requires_grad and "lora_A" not in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.1)
    theirs.save_pretrained(directory)
    return theirs.eval()


def test_we_load_an_adapter_peft_saved_tied_or_not(tmp_path):
    for family in ("llama", "gemma2"):  # untied, tied
        peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=list(SAVED),
                                      ensure_weight_tying=family == "gemma2", task_type="CAUSAL_LM")
        theirs = saved_by_peft(family, peft_config, tmp_path / family)
        ours = base(family, torch.float64)
        load_adapters(ours, tmp_path / family)
        with torch.no_grad():
            assert_equal_in_exact_arithmetic(ours(**inputs()).logits, theirs(**inputs()).logits,
                                             f"{family}: PEFT's logits")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_merged_model_is_the_adapters_and_a_tied_pair_stays_one_weight(family):
    model = base(family, torch.float64)
    inject_lora(model, lora_config(family))
    trained(model)
    with torch.no_grad():
        adapted = model.eval()(**inputs()).logits
        merge_and_unload(model)
        assert not list(lora_modules(model)) and not any(isinstance(m, ModulesToSave) for m in model.modules())
        assert not any(p.requires_grad for p in model.parameters())
        assert_equal_in_exact_arithmetic(model(**inputs()).logits, adapted, "the merged model")
    assert (model.get_input_embeddings().weight is model.get_output_embeddings().weight) == (family == "gemma3")


def test_a_tied_models_embedding_alone_trains_the_pair_and_the_bf16_base_keeps_its_dtype():
    """A tied model's embedding listed alone is the pair (training one would untie them); the
    copies train in fp32 under a bf16 base, whose forward still runs in bf16."""
    model = base("gemma2", torch.bfloat16)
    inject_lora(model, LoraConfig(r=4, alpha=8, modules_to_save=["embed_tokens"]))
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    copies = [module.modules_to_save["default"].weight for module in (embedding, head)]
    assert isinstance(head, ModulesToSave) and copies[0] is copies[1]
    assert embedding.modules_to_save["default"].weight.dtype == torch.float32
    assert embedding.original_module.weight.dtype == torch.bfloat16
    assert model(**inputs()).logits.dtype == torch.bfloat16
    trainable = [n for n, _ in named_lora_parameters(model) if "modules_to_save" in n]
    assert trainable == ["model.embed_tokens.modules_to_save.default.weight"]


def test_what_cannot_hold_them_says_so(tmp_path):
    config = lora_config("llama")
    with pytest.raises(ValueError, match="with adapters side by side"):
        inject_lora(base("llama", torch.float32), {"a": config, "b": config})
    with pytest.raises(ValueError, match="'wte' matches no module"):
        inject_lora(base("llama", torch.float32), LoraConfig(modules_to_save=["wte"]))
    with pytest.raises(ValueError, match="are LoRA targets too"):
        LoraConfig(target_modules=["q_proj", "lm_head"], modules_to_save=["lm_head"])
    model = base("llama", torch.float32)
    inject_lora(model, config)
    save_adapters(model, tmp_path, config, "tiny")
    with pytest.raises(ValueError, match="only a merged model carries"):  # a LoRA GGUF, a combination
        read_adapter_weights(tmp_path)
    plain = copy.deepcopy(base("llama", torch.float32))
    inject_lora(plain, LoraConfig(r=4, alpha=8))
    with pytest.raises(ValueError, match="2 unexpected: base_model.model.lm_head.weight; base_model.model.model.embed"):
        load_adapters(plain, tmp_path)


def test_under_a_quantized_base_the_copies_stay_full_precision_and_compute_the_dequantized_models_loss():
    """model.quantize stores the decoder Linears quantized; the embeddings and output layer stay
    whole, so their copies are the base's values in fp32, and the loss and the copies' gradients
    are those of the same model with the dequantized weights put back as plain Linears."""
    from finetuning_pipeline.model.quantized_base import quantize_base
    from lora_logic.quantized_linear import QuantizedLinear

    quantized = base("llama", torch.float64)
    quantize_base(quantized, "q8_0")
    plain = copy.deepcopy(quantized)
    for name, module in list(plain.named_modules()):
        if isinstance(module, QuantizedLinear):
            parent, _, child = name.rpartition(".")
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=False, dtype=torch.float64)
            linear.weight.data = module.dequantized_weight().to(torch.float64)
            setattr(plain.get_submodule(parent), child, linear)
    results = []
    for model in (quantized, plain):
        torch.manual_seed(1)  # the same LoRA A on both
        inject_lora(model, lora_config("llama"))
        trained(model)
        assert type(model.lm_head.original_module) is torch.nn.Linear
        results.append(loss_and_grads(model.train()))
    assert any(isinstance(m, QuantizedLinear) for m in quantized.modules())
    (logits, grads), (plain_logits, plain_grads) = results
    assert_equal_in_exact_arithmetic(logits, plain_logits, "logits over the quantized base")
    for name in grads:
        assert_equal_in_exact_arithmetic(grads[name], plain_grads[name], f"{name}'s gradient")
