"""From a conversation to the texts a model is trained on, with the character spans of the
answers it learns to write.

Each assistant answer is trained exactly as the model will write it: after the prompt the
chat template renders for it (`render(history, add_generation_prompt=True)`), the text the
template appends when the answer is the conversation's last turn. A token is trained on when
its first character lies inside a span; the end-of-turn marker that closes an answer is inside
it, the whitespace after it is not.

Most templates (ChatML, Llama 3, Gemma 3, Mistral v0.1, Qwen2.5) render a conversation
incrementally: each prefix of the conversation renders to a prefix of the whole. Then the whole
conversation is one sample and every answer is a span in it:
    prompt_i = render(turns[:i], add_generation_prompt=True)   # ends where answer i starts
    upto_i   = render(turns[:i + 1])                           # ends after its end marker

Other templates render earlier turns differently from the last one: Qwen3 drops the `<think>`
block of answers before the last user turn, Mistral v0.3 moves the system prompt into the last
user turn. Training answer i inside the whole conversation would teach text the model never
writes at that point, so each answer becomes a sample of its own: prompt_i followed by answer i
as the template renders it last. Where the prompt is rendered differently in `upto_i` (Mistral
v0.3 drops the system prompt once the user turn is no longer last), answer i starts in `upto_i`
at the latest point before its content up to which the text from the last user turn on reads
as prompt_i's ending (that turn, its closing, the generation prompt). This costs one sample per
answer (the history is repeated), so it is taken only when a template needs it.

A conversation whose answers cannot be located, or that the template itself refuses (its
`raise_exception`: a system turn Mistral v0.1 does not support, roles that do not alternate), is
an `InvalidRecord`: prepare names its FILE:LINE.
"""

from __future__ import annotations

import os

from jinja2 import TemplateError

from dataset.chat_template import CHATML_TEMPLATE
from dataset.errors import InvalidRecord

# Stand-ins for an answer's content, to find where the content starts: private-use characters
# (no template trims or splits on them); two, so one differs from the answer's first character.
CONTENT_PROBES = ("\ue000", "\ue001")


def chat_template_of(tokenizer) -> str:
    return tokenizer.chat_template or CHATML_TEMPLATE


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


TextWithSpans = tuple[str, list[tuple[int, int]]]  # a text to train on and the spans of its answers


def training_samples(render: ChatRenderer, messages: list[dict]) -> list[TextWithSpans]:
    """The samples of one conversation (it ends with an assistant turn: validation guarantees
    it). Raises InvalidRecord when the template refuses it or its answers cannot be located."""
    try:
        answers = [(index, render(messages[:index], True), render(messages[: index + 1], False))
                   for index, message in enumerate(messages) if message["role"] == "assistant"]
    except TemplateError as err:  # the template's raise_exception, or an undefined it meets in this record
        raise InvalidRecord("chat_template_refused", f"the chat template refused this conversation ({err}); "
                            "make the record fit the template (for instance: no system turn, roles alternating "
                            "user/assistant) or give the tokenizer another chat_template") from None
    incremental = all(upto.startswith(prompt) for _, prompt, upto in answers) and all(
        later.startswith(earlier) for (_, _, earlier), (_, _, later) in zip(answers, answers[1:]))
    if incremental:
        spans = [(len(prompt), len(upto.rstrip())) for _, prompt, upto in answers]
        return [(answers[-1][2], [(start, end) for start, end in spans if end > start])]
    samples = []
    for index, prompt, upto in answers:
        answer = upto[answer_start(render, messages, index, prompt, upto):]
        end = len(prompt) + len(answer.rstrip())
        samples.append((prompt + answer, [(len(prompt), end)] if end > len(prompt) else []))
    return samples


def answer_start(render: ChatRenderer, messages: list[dict], index: int, prompt: str, upto: str) -> int:
    """Where answer `index` begins in `upto` (the conversation rendered up to and with it)."""
    if upto.startswith(prompt):
        return len(prompt)
    content = messages[index]["content"]
    probe = CONTENT_PROBES[content.startswith(CONTENT_PROBES[0])]
    probed = render([*messages[:index], {**messages[index], "content": probe}], False)
    content_at = len(os.path.commonprefix([upto, probed]))  # the answer's text starts here, or after
    # The turn the answer replies to, and what follows it up to the answer's start, must read as
    # the prompt's ending: then both renderings close that turn and open the answer the same way.
    asked = messages[index - 1]["content"].strip() if index else ""
    asked_at = upto.rfind(asked, 0, content_at) if asked else -1
    ends = [end for end in range(asked_at + len(asked), content_at + 1)
            if asked_at >= 0 and prompt.endswith(upto[asked_at:end])]
    if not ends:
        raise InvalidRecord(
            "chat_template_unlocatable",
            f"the chat template does not render conversations incrementally, and the answer messages[{index}] "
            "cannot be located: the template renders it after other text than the prompt it gives the model "
            "(add_generation_prompt=True), so no training text matches what the model will see. Give the "
            "tokenizer a chat_template whose generation prompt is followed by its answers (like the built-in "
            "ChatML, dataset/chat_template.py)")
    return ends[-1]
