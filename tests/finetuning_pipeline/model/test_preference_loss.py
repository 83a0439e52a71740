"""The preference losses against TRL 1.16's DPOTrainer (the oracle: a test-only dependency, as
PEFT is): the same base, a PEFT model whose "default" adapter is our policy and whose "ref"
adapter is our reference, the same pairs. Loss, every LoRA gradient and TRL's logged metrics,
for each loss type: within FLOAT64_EXACT in float64 and FP32_BOUND in fp32.

TRL computes its log-probabilities in fp32 whatever the model's dtype: its fused LM head
(trl/kernels/chunked_logprob.py) accumulates logsumexp statistics and gradients in fp32 tiles.
In fp32 TRL runs as it is. In float64 its head is replaced by the same quantities computed from
the whole logits in the model's dtype (`exact_log_probs`: log-softmax gathered at the labels),
and everything else is TRL's own: the reference routing through its "ref" adapter, the rows'
order, the loss formulas, the reductions and the metrics."""

from __future__ import annotations

import pytest
import torch
from tolerances import FLOAT64_EXACT, FP32_UNIT_ROUNDOFF

from dataset.encode import IGNORE_INDEX
from finetuning_pipeline.model.preference_loss import (
    BASE_REFERENCE,
    METRIC_SUMS,
    PreferenceSettings,
    pair_losses,
    preference_loss_sum,
)
from lora_logic.adapters import lora_modules, only_adapter
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora

PAIRS = [
    {"prompt": "Which county is Brașov in?", "chosen": " Județul Brașov, in Transilvania.",
     "rejected": " Județul Cluj."},
    {"prompt": "Name the river of Sibiu.", "chosen": " The Cibin.", "rejected": " The Mureș, which is long."},
    {"prompt": "Where is Iași?", "chosen": " In Moldova, in the north east.", "rejected": " In Oltenia."},
]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FP32_BOUND = 1e-5
FAMILIES = ["mistral", "llama", "qwen2"]  # the demo's tiny Mistral; Llama's shape; Qwen2's q/k/v biases


@pytest.fixture(scope="module")
def family_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """A model directory per family, random weights of a small shape, with the demo's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    dirs = {"mistral": str(tiny_model_dir)}
    for family, config in (("llama", LlamaConfig), ("qwen2", Qwen2Config)):
        torch.manual_seed(0)
        dirs[family] = str(tmp_path_factory.mktemp(family))
        AutoModelForCausalLM.from_config(config(**shape)).save_pretrained(dirs[family])
        tokenizer.save_pretrained(dirs[family])
    return dirs


class ExactLogProbs:
    """A stand-in for TRL's fused head (`ChunkedLogProbFunction.apply`'s arguments and results)
    that computes in the hidden states' dtype: for the plain heads of the model used here (no
    bias, soft cap, scale or temperature)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs):
        assert bias is None and softcap is None and logit_scale == 1.0 and temperature == 1.0
        logits = hidden @ weight.to(hidden.dtype).t()
        log_probs = logits.log_softmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        is_top1 = logits.argmax(-1) == targets
        return log_probs.gather(1, targets[:, None]).squeeze(1), entropy, None, logits.mean(-1).detach(), is_top1


@pytest.fixture
def exact_log_probs(monkeypatch):
    import trl.trainer.utils

    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", ExactLogProbs)


def trl_trainer(model_dir, tmp_path, dtype, loss_type: str, beta: float):
    """TRL's DPOTrainer over PAIRS on a PEFT model of the base in model_dir; its "ref" adapter
    (TRL's copy of "default") and "default" both given random weights."""
    import peft
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir).to(dtype)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, loss_type=[loss_type], report_to=[],
                     use_cpu=True, bf16=False, fp16=False, max_length=None, dataloader_num_workers=0)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(PAIRS), processing_class=tokenizer)
    trainer.model.to("cpu")  # accelerate places it on torch_xla's device wherever torch_xla is installed
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.1)
    return trainer


def our_model(model_dir, trainer, dtype):
    """The same base with our LoRA: adapters "default" and "ref", TRL's weights copied in."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).to(dtype)
    config = LoraConfig(r=4, alpha=8, target_modules=TARGETS)
    inject_lora(model, {"default": config, "ref": config})
    theirs = trainer.model.base_model.model
    with torch.no_grad():
        for name, module in lora_modules(model):
            peft_module = theirs.get_submodule(name)
            for adapter in ("default", "ref"):
                module.lora_A[adapter].weight.copy_(peft_module.lora_A[adapter].weight)
                module.lora_B[adapter].weight.copy_(peft_module.lora_B[adapter].weight)
    return model.train()


def pair_batch(examples: list[dict]) -> dict[str, torch.Tensor]:
    """TRL's tokenized pairs as our rows: prompt + completion from position 0, padded on the
    right to one length, labels on the completion only."""
    length = max(len(e["prompt_ids"]) + max(len(e["chosen_ids"]), len(e["rejected_ids"])) for e in examples)
    batch = {}
    for side in ("chosen", "rejected"):
        ids = torch.zeros(len(examples), length, dtype=torch.int32)
        labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.int32)
        for row, example in enumerate(examples):
            prompt, completion = example["prompt_ids"], example[f"{side}_ids"]
            ids[row, :len(prompt) + len(completion)] = torch.tensor(prompt + completion)
            labels[row, len(prompt):len(prompt) + len(completion)] = torch.tensor(completion)
        batch[f"{side}_input_ids"], batch[f"{side}_labels"] = ids, labels
    return batch


@pytest.mark.parametrize("dtype, bound", [(torch.float64, FLOAT64_EXACT), (torch.float32, FP32_BOUND)],
                         ids=["float64", "fp32"])
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_gradients_and_metrics_equal_trl(family_dirs, tmp_path, family, loss_type, dtype, bound, request):
    beta = 0.3
    if dtype == torch.float64:
        request.getfixturevalue("exact_log_probs")
    model_dir = family_dirs[family]
    trainer = trl_trainer(model_dir, tmp_path, dtype, loss_type, beta)
    examples = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    trainer.model.train()
    their_loss = trainer.compute_loss(trainer.model, trainer.data_collator(examples))
    their_loss.backward()
    their_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    model = our_model(model_dir, trainer, dtype)
    with only_adapter(model, "default"):
        loss_sum, pairs, sums = preference_loss_sum(model, pair_batch(examples), PreferenceSettings(loss_type, beta),
                                                    reference="ref")
    (loss_sum / pairs).backward()

    assert pairs.item() == len(PAIRS)
    assert abs((loss_sum / pairs).item() - their_loss.item()) <= bound * max(1.0, abs(their_loss.item()))
    theirs = trainer.model.base_model.model
    compared = 0
    for name, module in lora_modules(model):
        for matrix in ("lora_A", "lora_B"):
            ours = getattr(module, matrix)["default"].weight.grad
            expected = getattr(theirs.get_submodule(name), matrix)["default"].weight.grad
            scale = max(1.0, expected.abs().max().item())
            assert (ours - expected).abs().max().item() <= bound * scale, (name, matrix)
            assert getattr(module, matrix)["ref"].weight.grad is None  # the reference is frozen in the step
            compared += 1
    assert compared == 2 * 7 * model.config.num_hidden_layers
    for index, metric in enumerate(METRIC_SUMS):
        value = (sums[index] / pairs).item()
        # TRL averages the accuracies' 0s and 1s in fp32 (`.float()`), whatever the model's dtype.
        metric_bound = max(bound, FP32_UNIT_ROUNDOFF) if metric == "rewards/accuracies" else bound
        assert abs(value - their_metrics[metric]) <= metric_bound * max(1.0, abs(their_metrics[metric])), metric
    # Not a vacuous comparison: the policy is not the reference, and the loss is far from its start.
    assert abs(their_metrics["rewards/margins"]) > 1e-3


def test_base_reference_is_the_model_without_adapters(tiny_model_dir, tmp_path, exact_log_probs):
    """TRL's reference for a new adapter is the base (adapters disabled); ours routes every row
    through BASE_REFERENCE, an adapter no layer holds."""
    trainer = trl_trainer(tiny_model_dir, tmp_path, torch.float64, "sigmoid", 0.1)
    model = our_model(tiny_model_dir, trainer, torch.float64)
    trainer.model.delete_adapter("ref")  # TRL then disables the adapters for its reference
    trainer.model.set_adapter("default")
    examples = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    their_loss = trainer.compute_loss(trainer.model.train(), trainer.data_collator(examples))

    with only_adapter(model, "default"):
        loss_sum, pairs, _ = preference_loss_sum(model, pair_batch(examples), PreferenceSettings(), BASE_REFERENCE)
    assert abs((loss_sum / pairs).item() - their_loss.item()) <= FLOAT64_EXACT


def test_policy_equal_to_reference_gives_ln2_and_no_margin(tiny_model_dir, tmp_path):
    """At a continuing phase's first step the reference is the adapter itself: the sigmoid loss is
    ln 2 and every reward 0."""
    trainer = trl_trainer(tiny_model_dir, tmp_path, torch.float64, "sigmoid", 0.1)
    model = our_model(tiny_model_dir, trainer, torch.float64)
    with torch.no_grad():
        for _, module in lora_modules(model):
            module.lora_A["ref"].weight.copy_(module.lora_A["default"].weight)
            module.lora_B["ref"].weight.copy_(module.lora_B["default"].weight)
    examples = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    with only_adapter(model, "default"):
        loss_sum, pairs, sums = preference_loss_sum(model, pair_batch(examples), PreferenceSettings(), "ref")
    assert abs((loss_sum / pairs).item() - torch.log(torch.tensor(2.0, dtype=torch.float64)).item()) <= FLOAT64_EXACT
    assert sums[METRIC_SUMS.index("rewards/margins")].item() == 0.0


def test_pair_losses_by_hand():
    """The formulas on numbers worked by hand: log-ratios chosen 2 and rejected -1 (beta 0.5)."""
    policy = torch.tensor([-3.0, -6.0], dtype=torch.float64)  # chosen, rejected
    reference = torch.tensor([-5.0, -5.0], dtype=torch.float64)
    tokens = torch.tensor([4.0, 2.0], dtype=torch.float64)
    def loss(kind):
        return pair_losses(PreferenceSettings(kind, 0.5), policy, reference, tokens).item()

    assert loss("sigmoid") == pytest.approx(-torch.nn.functional.logsigmoid(torch.tensor(1.5)).item())
    assert loss("hinge") == pytest.approx(0.0)  # 1 - 0.5 * 3 < 0
    assert loss("ipo") == pytest.approx((2 / 4 - (-1) / 2 - 1) ** 2)


@pytest.mark.parametrize("field, value", [("loss", "kto"), ("beta", 0), ("beta", "0.1"), ("beta", True)])
def test_settings_refuse_what_they_cannot_train(field, value):
    with pytest.raises(ValueError, match=f"preference.{field}"):
        PreferenceSettings(**{field: value})


def trl_orpo_loss(model, batch: dict[str, torch.Tensor], beta: float) -> tuple[torch.Tensor, dict]:
    """TRL's ORPOTrainer.get_batch_loss_metrics on `model` (a PEFT model) and our pair rows in its
    batch layout (its own tokenization is not what is compared: the loss on the same tokens is),
    through a stand-in for the trainer's few attributes those methods read."""
    import functools
    from types import SimpleNamespace

    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    trainer = SimpleNamespace(is_encoder_decoder=False, padding_value=0, aux_loss_enabled=False, beta=beta,
                              accelerator=SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x),
                              concatenated_inputs=ORPOTrainer.concatenated_inputs,
                              get_batch_logps=ORPOTrainer.get_batch_logps)
    trainer.concatenated_forward = functools.partial(ORPOTrainer.concatenated_forward, trainer)
    trainer.odds_ratio_loss = functools.partial(ORPOTrainer.odds_ratio_loss, trainer)
    theirs = {}
    positions = torch.arange(batch["chosen_labels"].shape[1])
    for side in ("chosen", "rejected"):
        labels = batch[f"{side}_labels"].long()
        last = torch.where(labels != IGNORE_INDEX, positions, -1).amax(-1, keepdim=True)
        theirs[f"{side}_input_ids"] = batch[f"{side}_input_ids"].long()
        theirs[f"{side}_attention_mask"] = (positions <= last).long()
        theirs[f"{side}_labels"] = labels
    return ORPOTrainer.get_batch_loss_metrics(trainer, model, theirs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "fp32"])
def test_orpo_loss_gradients_and_metrics_equal_trl(tiny_model_dir, tmp_path, dtype):
    """TRL's ORPO computes its odds-ratio term in fp32 whatever the model's dtype (`.float()` in
    odds_ratio_loss): its bound is fp32's in both dtypes, FP32_BOUND."""
    import peft

    trainer = trl_trainer(tiny_model_dir, tmp_path, dtype, "sigmoid", 0.1)  # (for TRL's tokenized pairs only)
    examples = [trainer.train_dataset[i] for i in range(len(PAIRS))]
    batch = pair_batch(examples)
    from transformers import AutoModelForCausalLM

    theirs = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(dtype),
                                 peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.1)
    their_loss, their_metrics = trl_orpo_loss(theirs.train(), batch, beta=0.3)
    their_loss.backward()

    from transformers import AutoModelForCausalLM as Auto

    ours = Auto.from_pretrained(tiny_model_dir).to(dtype)
    inject_lora(ours, LoraConfig(r=4, alpha=8, target_modules=TARGETS))
    with torch.no_grad():
        for name, module in lora_modules(ours):
            peft_module = theirs.base_model.model.get_submodule(name)
            module.lora_A["default"].weight.copy_(peft_module.lora_A["default"].weight)
            module.lora_B["default"].weight.copy_(peft_module.lora_B["default"].weight)
    loss_sum, pairs, sums = preference_loss_sum(ours.train(), batch, PreferenceSettings("orpo", 0.3), BASE_REFERENCE)
    (loss_sum / pairs).backward()

    assert abs((loss_sum / pairs).item() - their_loss.item()) <= FP32_BOUND
    for name, module in lora_modules(ours):
        for matrix in ("lora_A", "lora_B"):
            mine = getattr(module, matrix)["default"].weight.grad
            expected = getattr(theirs.base_model.model.get_submodule(name), matrix)["default"].weight.grad
            assert (mine - expected).abs().max().item() <= FP32_BOUND * max(1.0, expected.abs().max().item())
    for index, metric in enumerate(METRIC_SUMS):
        expected = float(their_metrics[metric])
        assert abs((sums[index] / pairs).item() - expected) <= FP32_BOUND * max(1.0, abs(expected)), metric
    assert abs(their_loss.item()) > 1e-3 and abs(float(their_metrics["rewards/margins"])) > 1e-4
