"""The results of adapters trained side by side, taken together: each adapter's, and their
label-token-weighted mean (the loss of their rows together), for the logs and the summary."""

from __future__ import annotations

import math


def weighted_mean(each: dict[str, dict]) -> float | None:
    """The label-token-weighted mean loss of adapters side by side (the loss of their rows together)."""
    tokens = sum(v["label_tokens"] for v in each.values() if v["loss"] is not None)
    if not tokens:
        return None
    return sum(v["loss"] * v["label_tokens"] for v in each.values() if v["loss"] is not None) / tokens


def side_by_side_results(each: dict[str, dict]) -> dict:
    """Evaluation results of adapters side by side: each adapter's, and their mean at the top."""
    loss = weighted_mean(each)
    pairs = any("pairs" in v for v in each.values())  # a preference loss has no perplexity
    return {"loss": loss, "perplexity": None if loss is None or pairs else math.exp(min(loss, 50.0)),
            "label_tokens": sum(v["label_tokens"] for v in each.values()), "adapters": each}
