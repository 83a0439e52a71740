"""Tokenize documents (phase 1) and conversations with their loss mask (phase 2).

Phase 1: [BOS] + document + [EOS] (BOS when the tokenizer has one); every token is a label.

Phase 2: each conversation becomes one or more texts with the character spans of its answers
(chat_samples.py: rendered with the tokenizer's chat template, our ChatML when it has none).
Labels are -100 everywhere except the tokens whose first character falls inside a span
(offsets from the fast tokenizer): the answers and the end-of-turn marker closing each.

All tokenization is batched: the Rust tokenizer spreads a batch over every core.
"""

from __future__ import annotations

import numpy as np

from dataset.chat_samples import ChatRenderer, training_samples
from dataset.errors import DataError, InvalidRecord

IGNORE_INDEX = -100  # the label PyTorch's cross-entropy skips


def encode_documents(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each document, with BOS (if any) before and EOS after."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token; phase 1 needs one to separate documents")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [bos + ids + eos for ids in encoded]


def encode_conversations(
    tokenizer, conversations: list[list[dict]], render: ChatRenderer | None = None
) -> list[list[tuple[np.ndarray, np.ndarray]] | InvalidRecord]:
    """For each conversation, its samples as (input_ids, labels) int32 arrays, labels masking all
    but the answers; or the InvalidRecord saying why it cannot be trained on. Pass one `render`
    for a whole run so the template is compiled once."""
    render = render or ChatRenderer(tokenizer)
    outcomes = []
    for messages in conversations:
        try:
            outcomes.append(training_samples(render, messages))
        except InvalidRecord as err:
            outcomes.append(err)
    texts = [text for outcome in outcomes if not isinstance(outcome, InvalidRecord) for text, _ in outcome]
    batch = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True) if texts else None
    encoded = iter(zip(batch["input_ids"], batch["offset_mapping"])) if batch else iter(())
    results = []
    for outcome in outcomes:
        if isinstance(outcome, InvalidRecord):
            results.append(outcome)
            continue
        results.append([labelled(ids, offsets, spans) for (_, spans), (ids, offsets) in zip(outcome, encoded)])
    return results


def labelled(ids: list[int], offsets: list, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(ids, dtype=np.int32)
    token_starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
    span_starts = np.asarray([s for s, _ in spans], dtype=np.int64)
    span_ends = np.asarray([e for _, e in spans], dtype=np.int64)
    # For each token, the last span starting at or before it; trained if it also ends after.
    which = np.searchsorted(span_starts, token_starts, side="right") - 1
    trained = (which >= 0) & (token_starts < span_ends[np.maximum(which, 0)]) if spans else np.zeros(len(ids), bool)
    return ids, np.where(trained, ids, IGNORE_INDEX).astype(np.int32)
