"""Rows of the embeddings trained beside the LoRA (lora.trainable_token_indices) against PEFT
0.21's TrainableTokens on the 7 families, Gemma's tied ones included: PEFT loads the adapter we
save and computes our logits and gradients, within 1e-10 in float64 and 1e-5 in fp32, with the
input embedding's rows (a list: PEFT's meaning; a tied output layer shares them) or the output
layer's too (a mapping); we load PEFT's; the merged model is the adapter's."""

from __future__ import annotations

import json

import pytest
import torch
from model_families import FAMILIES
from safetensors.torch import load_file
from test_modules_to_save import BOUNDS, base, inputs, loss_and_grads, saved_by_peft, trained
from tolerances import assert_equal_in_exact_arithmetic

from lora_logic.adapter_io import load_adapters, save_adapters
from lora_logic.adapters import named_lora_parameters
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora
from lora_logic.merge import merge_and_unload
from lora_logic.modules_to_save import tied_output_layer
from lora_logic.trainable_tokens import TrainableTokens

peft = pytest.importorskip("peft")
ROWS = [3, 17, 40, 95]
DELTA = "token_adapter.trainable_tokens_delta"


def config(family: str, both: bool) -> LoraConfig:
    from model_families import TARGETS

    rows = {"embed_tokens": list(ROWS), "lm_head": list(ROWS)} if both else list(ROWS)
    targets = TARGETS.get(family)
    return LoraConfig(r=4, alpha=8, trainable_token_indices=rows, **({"target_modules": targets} if targets else {}))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "fp32"])
@pytest.mark.parametrize("both", [False, True], ids=["embedding rows", "and output rows"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_loads_our_adapter_and_computes_our_logits_and_gradients(family, both, dtype, tmp_path):
    lora = config(family, both)
    ours = base(family, dtype)
    tied = tied_output_layer(ours) is not None
    inject_lora(ours, lora)
    trained(ours)
    save_adapters(ours, tmp_path, lora, "tiny")
    assert json.loads((tmp_path / "adapter_config.json").read_text())["trainable_token_indices"] == \
        lora.trainable_token_indices
    keys = {k for k in load_file(tmp_path / "adapter_model.safetensors") if "lora_" not in k}
    heads = both and not tied  # a tied output layer's rows are the embedding's: saved once
    assert keys == {f"base_model.model.model.embed_tokens.{DELTA}"} | ({f"base_model.model.lm_head.{DELTA}"}
                                                                        if heads else set())
    theirs = peft.PeftModel.from_pretrained(base(family, dtype), tmp_path, is_trainable=True)
    logits, grads = loss_and_grads(ours.train())
    their_logits, their_grads = loss_and_grads(theirs.train(), "base_model.model.")
    assert grads.keys() == their_grads.keys() and len(grads) == len(named_lora_parameters(ours))
    assert sum(DELTA in n for n in grads) == 1 + heads
    assert_equal_in_exact_arithmetic(logits, their_logits, "PEFT's logits", BOUNDS[dtype])
    for name in grads:
        assert_equal_in_exact_arithmetic(grads[name], their_grads[name], f"{name}'s gradient", BOUNDS[dtype])
    head = ours.get_output_embeddings()
    assert isinstance(head, TrainableTokens) == (tied or both)


def test_we_load_an_adapter_peft_saved_and_the_merged_model_is_the_adapters(tmp_path):
    for family in ("mistral", "gemma3"):  # untied, tied
        peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=list(ROWS),
                                      task_type="CAUSAL_LM")
        theirs = saved_by_peft(family, peft_config, tmp_path / family)
        ours = base(family, torch.float64)
        load_adapters(ours, tmp_path / family)
        with torch.no_grad():
            expected = theirs(**inputs()).logits
            assert_equal_in_exact_arithmetic(ours.eval()(**inputs()).logits, expected, f"{family}: PEFT's logits")
            merge_and_unload(ours)
            assert not any(isinstance(m, TrainableTokens) for m in ours.modules())
            assert_equal_in_exact_arithmetic(ours(**inputs()).logits, expected, f"{family}: merged")
        assert (ours.get_input_embeddings().weight is ours.get_output_embeddings().weight) == (family == "gemma3")


def test_only_the_listed_rows_move_and_bad_rows_are_refused():
    model = base("llama", torch.float32)
    before = model.get_input_embeddings().weight.detach().clone()
    inject_lora(model, config("llama", both=False))
    loss = model(**inputs()).loss
    loss.backward()
    (rows,) = [p for n, p in named_lora_parameters(model) if DELTA in n]
    assert rows.shape == (len(ROWS), before.shape[1]) and rows.grad is not None
    assert torch.equal(rows.detach(), before[ROWS])  # they start at the base's rows
    with pytest.raises(ValueError, match=r"distinct token ids in \[0, 96\)"):
        inject_lora(base("llama", torch.float32), LoraConfig(trainable_token_indices=[3, 96]))
    with pytest.raises(ValueError, match="same rows"):
        inject_lora(base("gemma2", torch.float32), LoraConfig(trainable_token_indices={"embed_tokens": [1],
                                                                                      "lm_head": [2]}))
    with pytest.raises(ValueError, match="whole or by rows"):
        LoraConfig(modules_to_save=["lm_head"], trainable_token_indices={"lm_head": [1]})
    with pytest.raises(ValueError, match="whole or by rows"):
        inject_lora(base("llama", torch.float32), LoraConfig(modules_to_save=["embed_tokens"],
                                                             trainable_token_indices=[1]))
