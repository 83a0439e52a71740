"""Tokenize documents (phase 1) and conversations with their loss mask (phase 2).

Phase 1: [BOS] + document + [EOS] (BOS when the tokenizer has one); every token is a label.

Phase 2: the conversation is rendered with the tokenizer's chat template (our ChatML when it
has none). Labels are -100 everywhere except the assistant's tokens and the end-of-turn
marker that closes each assistant turn. The assistant spans are found in characters, by
rendering the conversation turn by turn (see `ChatRenderer` for how that is kept cheap):
    prefix = render(turns[:i], add_generation_prompt=True)  # ends where the answer starts
    upto_i = render(turns[:i + 1])                          # ends after the answer's end marker
so the span is [len(prefix), len(upto_i.rstrip())), and a token is trained on when its
first character falls inside a span (offsets from the fast tokenizer). This works for any
template whose renderings of a prefix of the conversation are prefixes of each other;
a template without that property is reported, not mis-masked.

All tokenization is batched: the Rust tokenizer spreads a batch over every core.
"""

from __future__ import annotations

import numpy as np

from dataset.chat_template import CHATML_TEMPLATE
from dataset.errors import DataError

IGNORE_INDEX = -100  # the label PyTorch's cross-entropy skips


def chat_template_of(tokenizer) -> str:
    return tokenizer.chat_template or CHATML_TEMPLATE


def encode_documents(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each document, with BOS (if any) before and EOS after."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token; phase 1 needs one to separate documents")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [bos + ids + eos for ids in encoded]


class ChatRenderer:
    """Renders conversations with a tokenizer's chat template, fast.

    `tokenizer.apply_chat_template` deep-copies its inputs and re-checks its arguments on
    every call, which is most of its cost here (measured: 60% of phase-2 prepare time), and
    we render about two prefixes per answer. Our messages are validated plain strings, so
    the template is compiled once, with transformers' own compiler (same sandbox, filters
    and globals), and called directly with the same context `apply_chat_template` builds.
    The first conversation is rendered both ways; if they ever differ (another transformers
    version), every later render takes the slow, reference path.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.template = chat_template_of(tokenizer)
        self.context = dict(tokenizer.special_tokens_map)
        self.compiled = None
        self.checked = False
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self.compiled = _compile_jinja_template(self.template)
        except Exception:  # a private helper: without it, the reference path still works
            self.compiled = None

    def reference(self, turns: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            turns, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
        )

    def __call__(self, turns: list[dict], generation_prompt: bool) -> str:
        if self.compiled is None:
            return self.reference(turns, generation_prompt)
        fast = self.compiled.render(messages=turns, add_generation_prompt=generation_prompt, **self.context)
        if not self.checked:
            self.checked = True
            if fast != self.reference(turns, generation_prompt):
                self.compiled = None
                return self.reference(turns, generation_prompt)
        return fast


def render_with_spans(render: ChatRenderer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant answers.

    `messages` must end with an assistant turn (validation guarantees it), so the rendering
    up to the last answer is the whole conversation.
    """
    full = ""
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = render(messages[:index], True)
        upto = render(messages[: index + 1], False)
        if not (upto.startswith(prefix) and upto.startswith(full)):
            raise DataError(
                "the chat template does not render conversations incrementally (a prefix of the "
                "conversation does not render to a prefix of the text), so assistant tokens cannot "
                "be located; use a template like the built-in ChatML (dataset/chat_template.py)"
            )
        end = len(upto.rstrip())
        if end > len(prefix):
            spans.append((len(prefix), end))
        full = upto
    return full, spans


def encode_conversations(
    tokenizer, conversations: list[list[dict]], render: ChatRenderer | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, labels) as int32 arrays for each conversation; labels mask all but the answers.
    Pass one `render` for a whole run so the template is compiled once."""
    render = render or ChatRenderer(tokenizer)
    rendered = [render_with_spans(render, messages) for messages in conversations]
    batch = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    results = []
    for (_, spans), ids, offsets in zip(rendered, batch["input_ids"], batch["offset_mapping"]):
        ids = np.asarray(ids, dtype=np.int32)
        token_starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
        span_starts = np.asarray([s for s, _ in spans], dtype=np.int64)
        span_ends = np.asarray([e for _, e in spans], dtype=np.int64)
        # For each token, the last span starting at or before it; trained if it also ends after.
        which = np.searchsorted(span_starts, token_starts, side="right") - 1
        trained = (which >= 0) & (token_starts < span_ends[np.maximum(which, 0)])
        labels = np.where(trained, ids, IGNORE_INDEX).astype(np.int32)
        results.append((ids, labels))
    return results
