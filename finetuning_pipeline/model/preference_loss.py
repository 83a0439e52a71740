"""Preference losses over pairs (chosen, rejected): DPO's sigmoid, IPO and hinge, as TRL
1.16's `DPOTrainer` computes them, so that a step of ours and one of TRL's on the same model
and pairs take the same loss and the same gradients (tests/finetuning_pipeline/model/
test_preference_loss.py holds them to TRL in float64 and fp32).

A pair is two rows of one length: the prompt then the chosen completion, the prompt then the
rejected one, each from position 0 and padded on the right (dataset/preference.py writes them
so). Labels are -100 except on the completion's tokens. A sequence's log-probability is the sum
of its completion tokens' log-probabilities (TRL's `logps`, summed over the completion mask);
its reward is beta times its log-ratio to the reference, log pi(y|x) - log pi_ref(y|x):

    sigmoid  -log sigmoid(beta * (chosen log-ratio - rejected log-ratio))          (DPO)
    hinge    max(0, 1 - beta * (chosen log-ratio - rejected log-ratio))           (SLiC)
    ipo      (chosen log-ratio / chosen tokens - rejected log-ratio / rejected tokens
              - 1 / (2 beta)) ** 2                                  (IPO, TRL's per-token average)

The loss of a batch is the mean over its pairs. The training step accumulates sums (the loss
summed over pairs, and the pair count) and divides once by the step's pairs, as it divides an
SFT step's token losses by its label tokens (train/step.py): k micro-batches of p pairs give
exactly the gradient of one batch of k*p pairs.

The reference log-probabilities come from the model itself with another adapter in its layers
(the frozen copy of the adapter the phase continues), or with none (the base): `only_adapter`
routes every row through one of them, without a second model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dataset.encode import IGNORE_INDEX
from finetuning_pipeline.model.attention_masks import attention_masks
from lora_logic.adapters import only_adapter
from utils.precision import at_least_fp32

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "orpo")
REFERENCE_FREE = ("orpo",)  # losses without a reference model
# An adapter name no layer holds: routed through it, every row sees the base alone.
BASE_REFERENCE = "<base>"
# The frozen copy of the adapter a phase continues, held beside it (LoRALinear.add_frozen_copy).
REFERENCE_ADAPTER = "reference"
# The sums a preference batch adds to its step, each over the batch's pairs (the metrics are
# these divided by "pairs": TRL's names, metrics.py).
METRIC_SUMS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
               "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class PreferenceSettings:
    """A preference phase's loss: `loss` one of LOSS_TYPES, `beta` its temperature (TRL's default 0.1)."""

    loss: str = "sigmoid"
    beta: float = 0.1

    def __post_init__(self) -> None:
        if self.loss not in LOSS_TYPES:
            raise ValueError(f"preference.loss: {self.loss!r} is not one of {list(LOSS_TYPES)}")
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not self.beta > 0:
            raise ValueError(f"preference.beta: must be a number > 0, got {self.beta!r}")


def pair_rows(batch: dict[str, torch.Tensor], groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) [2P, L]: the chosen rows, then the rejected ones (TRL's order); adapters
    side by side (groups K, the batch's pairs K equal parts, adapter after adapter): each adapter's
    chosen then rejected rows, adapter after adapter, so that each row group of the LoRA layers
    (lora_logic/layer.py) is one adapter's rows."""
    def rows(kind: str) -> torch.Tensor:
        parts = zip(batch[f"chosen_{kind}"].chunk(groups), batch[f"rejected_{kind}"].chunk(groups))
        return torch.cat([row for chosen, rejected in parts for row in (chosen, rejected)]).long()

    return rows("input_ids"), rows("labels")


def token_logps(model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[rows, L - 1]: each next token's log-probability where `labels` names it (token t predicts
    token t + 1), 0 elsewhere, fp32 or wider. Rows start at position 0 and are padded on the
    right: the causal mask alone keeps a row's tokens from its padding."""
    masks = attention_masks(model.config, input_ids.shape[1], input_ids.device, model.dtype, None)
    logits = model(input_ids=input_ids, attention_mask=masks, use_cache=False).logits[:, :-1]
    targets = labels[:, 1:]
    return -F.cross_entropy(at_least_fp32(logits).reshape(-1, logits.shape[-1]), targets.reshape(-1),
                            ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape)


def sequence_logps(model, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of each row's label tokens' log-probabilities, each row's label tokens), [rows] each."""
    logps = token_logps(model, input_ids, labels)
    return logps.sum(-1), (labels[:, 1:] != IGNORE_INDEX).sum(-1).to(logps.dtype)


@torch.no_grad()
def reference_logps(model, input_ids: torch.Tensor, labels: torch.Tensor, reference: str) -> torch.Tensor:
    """Each row's completion log-probability under the reference: the model with every row routed
    through adapter `reference` (BASE_REFERENCE: none, the base alone). No graph is kept."""
    with only_adapter(model, reference):
        return sequence_logps(model, input_ids, labels)[0]


def pair_losses(settings: PreferenceSettings, policy: torch.Tensor, reference: torch.Tensor,
                tokens: torch.Tensor) -> torch.Tensor:
    """Each pair's loss, [P]. policy, reference: [2P] completion log-probabilities (chosen rows
    then rejected); tokens: [2P] completion tokens (IPO averages over them)."""
    chosen_ratio, rejected_ratio = (policy - reference).chunk(2)
    beta = settings.beta
    if settings.loss == "sigmoid":
        return -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    if settings.loss == "hinge":
        return torch.relu(1 - beta * (chosen_ratio - rejected_ratio))
    chosen_tokens, rejected_tokens = tokens.clamp(min=1.0).chunk(2)
    return (chosen_ratio / chosen_tokens - rejected_ratio / rejected_tokens - 1 / (2 * beta)) ** 2


def metric_sums(settings: PreferenceSettings, policy: torch.Tensor, reference: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
    """METRIC_SUMS of a batch, [6], summed over its pairs (weight: [P], 1 for a pair, 0 for an
    evaluation's filler row), no gradient."""
    policy, reference = policy.detach(), reference.detach()
    chosen_logps, rejected_logps = policy.chunk(2)
    chosen_rewards, rejected_rewards = (settings.beta * (policy - reference)).chunk(2)
    values = [chosen_rewards, rejected_rewards, (chosen_rewards > rejected_rewards).to(policy.dtype),
              chosen_rewards - rejected_rewards, chosen_logps, rejected_logps]
    return torch.stack([(value * weight).sum() for value in values])


def preference_loss_sum(model, batch: dict[str, torch.Tensor], settings: PreferenceSettings, reference: str,
                        groups: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss summed over the batch's pairs, pair count, METRIC_SUMS) of one batch of pairs, on
    the device. A row of no completion token (the filler an evaluation's last batch is padded
    with) is no pair: it adds nothing to any of them. The reference log-probabilities are
    batch["reference_logps"] ([P, 2]: each pair's chosen and rejected, computed before the phase)
    when given, else the model's through adapter `reference`. groups > 1: adapters side by side
    (pair_rows), each's sums its own: [K], [K] and [K, 6]."""
    input_ids, labels = pair_rows(batch, groups)
    if settings.loss == "orpo":
        return orpo_loss_sum(model, batch, settings, groups)
    if "reference_logps" in batch:
        given = batch["reference_logps"].to(torch.promote_types(model.dtype, torch.float32))
        # each adapter's chosen rows, then its rejected rows (pair_rows' order)
        reference_values = torch.cat([column for part in given.chunk(groups) for column in (part[:, 0], part[:, 1])])
    else:
        reference_values = reference_logps(model, input_ids, labels, reference)
    policy, tokens = sequence_logps(model, input_ids, labels)
    sums = []
    for k, real in enumerate((batch["chosen_labels"] != IGNORE_INDEX).any(-1).chunk(groups)):
        rows = slice(2 * k * real.shape[0], 2 * (k + 1) * real.shape[0])  # adapter k's rows
        losses = pair_losses(settings, policy[rows], reference_values[rows], tokens[rows])
        weight = real.to(losses.dtype)
        # The pairs counted in fp32 from integers, as a next-token batch's label tokens are (a float64
        # run keeps a float64 value float64, and the step's running count is one tensor of one dtype).
        sums.append(((losses * weight).sum(), real.sum().to(torch.float32),
                     metric_sums(settings, policy[rows], reference_values[rows], weight)))
    return by_adapter(sums)


def metrics_of(sums: list[float], pairs: float) -> dict[str, float | None]:
    """TRL's metrics, each a mean over pairs, from METRIC_SUMS' host values (None without pairs)."""
    return {name: (value / pairs if pairs else None) for name, value in zip(METRIC_SUMS, sums, strict=True)}


def by_adapter(sums: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One adapter's (loss sum, pairs, metric sums), or each's stacked: [K], [K], [K, 6]."""
    if len(sums) == 1:
        return sums[0]
    loss_sums, pairs, metrics = zip(*sums)
    return torch.stack(loss_sums), torch.stack(pairs), torch.stack(metrics)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, in TRL's two branches (each where it does not cancel)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss_sum(model, batch: dict[str, torch.Tensor], settings: PreferenceSettings, groups: int = 1,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO (Hong et al. 2024) as TRL's ORPOTrainer computes it, without a reference: a batch's
    loss is the next-token loss of its chosen rows (every token after the first, the prompt's too,
    their mean over the batch's tokens) minus beta times the mean over its pairs of
    log sigmoid(log-odds), the log-odds of the chosen completion's per-token average log-probability
    against the rejected one's. Returned as preference_loss_sum's sums: the batch's pairs times its
    next-token mean plus beta times the summed odds terms, so that the step's division by its pairs
    gives TRL's loss for one micro-batch; over several, the mean of their losses (TRL's gradient
    accumulation: each micro-batch's next-token mean is over its own tokens). The metrics are TRL's
    ORPO metrics: the rewards beta times the average log-probabilities, the logps those averages."""
    input_ids, labels = pair_rows(batch, groups)
    positions = torch.arange(labels.shape[1], device=labels.device)
    last = torch.where(labels != IGNORE_INDEX, positions, -1).amax(-1, keepdim=True)  # a row ends with its completion
    every = torch.where(positions <= last, input_ids, IGNORE_INDEX)  # its real tokens, prompt included
    logps = token_logps(model, input_ids, every)
    completion = labels[:, 1:] != IGNORE_INDEX
    average = (logps * completion).sum(-1) / completion.sum(-1).clamp(min=1)
    # A filler row (no completion: an evaluation's padding) has no log-probability: a stand-in of -1,
    # not 0, whose log(1 - exp(0)) would be -inf and its weight of 0 no cure for the NaN it makes.
    average = torch.where(completion.any(-1), average, torch.full_like(average, -1.0))
    real_tokens = every[:, 1:] != IGNORE_INDEX
    sums = []
    for k, real in enumerate((batch["chosen_labels"] != IGNORE_INDEX).any(-1).chunk(groups)):
        pairs = real.shape[0]
        chosen, rejected = slice(2 * k * pairs, (2 * k + 1) * pairs), slice((2 * k + 1) * pairs, 2 * (k + 1) * pairs)
        weight = real.to(average.dtype)
        nll = -(logps[chosen] * real_tokens[chosen]).sum() / real_tokens[chosen].sum().clamp(min=1)
        log_odds = (average[chosen] - average[rejected]) - (log1mexp(average[chosen]) - log1mexp(average[rejected]))
        odds_terms = -F.logsigmoid(log_odds) * weight
        count = real.sum()
        policy = torch.cat([average[chosen], average[rejected]])
        sums.append((count.to(nll.dtype) * nll + settings.beta * odds_terms.sum(), count.to(torch.float32),
                     metric_sums(settings, policy, torch.zeros_like(policy), weight)))
    return by_adapter(sums)


@dataclass(frozen=True)
class PreferenceObjective:
    """A preference phase's loss, as the training step calls it (train/step.py's `objective`):
    objective(model, batch) -> preference_loss_sum's (loss sum, pairs, METRIC_SUMS).
    reference: the adapter the reference's rows go through (BASE_REFERENCE: the base)."""

    settings: PreferenceSettings
    reference: str

    def __call__(self, model, batch: dict[str, torch.Tensor], groups: int = 1,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return preference_loss_sum(model, batch, self.settings, self.reference, groups)
