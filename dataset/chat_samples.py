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
block of answers before the last user turn, DeepSeek-R1 strips earlier reasoning, Mistral v0.3
moves the system prompt into the last user turn. Training answer i inside the whole
conversation would teach text the model never writes at that point, so each answer becomes a
sample of its own: prompt_i followed by answer i as the template renders it last. Where the
prompt is rendered differently in `upto_i` (Mistral v0.3 drops the system prompt once the user
turn is no longer last), the answer's start in `upto_i` is the point whose preceding text shares
the longest ending with prompt_i (the last user turn and the generation prompt), searched
before the answer's content. This costs one sample per answer (the history is repeated), so it
is taken only when a template needs it.

A conversation whose answers cannot be located, or that the template itself refuses (its
`raise_exception`: a system turn Mistral v0.1 does not support, roles that do not alternate), is
an `InvalidRecord`: prepare names its FILE:LINE.
"""

from __future__ import annotations

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


Sample = tuple[str, list[tuple[int, int]]]  # a text to train on and the spans of its answers


def training_samples(render: ChatRenderer, messages: list[dict]) -> list[Sample]:
    """The samples of one conversation (it ends with an assistant turn: validation guarantees
    it). Raises InvalidRecord when the template refuses it or its answers cannot be located."""
    try:
        answers = [(index, render(messages[:index], True), render(messages[: index + 1], False))
                   for index, message in enumerate(messages) if message["role"] == "assistant"]
    except Exception as err:  # the template's raise_exception, or a render that fails on this record
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
    content_at = common_prefix_length(upto, probed)
    ending, start = longest_shared_ending(upto[:content_at], prompt)
    # The shared ending must hold the turn the answer replies to: then both renderings end that
    # turn (and open the answer) the same way. Anything shorter could be a coincidence.
    asked = messages[index - 1]["content"].strip() if index else None
    if not asked or asked not in prompt[len(prompt) - ending:]:
        raise InvalidRecord(
            "chat_template_unlocatable",
            f"the chat template does not render conversations incrementally, and the answer messages[{index}] "
            "cannot be located: the template renders it after other text than the prompt it gives the model "
            "(add_generation_prompt=True), so no training text matches what the model will see. Give the "
            "tokenizer a chat_template whose generation prompt is followed by its answers (like the built-in "
            "ChatML, dataset/chat_template.py)")
    return start


def common_prefix_length(a: str, b: str) -> int:
    limit = min(len(a), len(b))
    low, high = 0, limit  # binary search on string slices: C speed, O(n log n)
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def longest_shared_ending(text: str, prompt: str) -> tuple[int, int]:
    """(length, end): the end position in `text` whose preceding characters share the longest
    ending with `prompt`; the latest such position on a tie. Z-algorithm on the reversed
    strings, linear in their lengths."""
    reversed_prompt, reversed_text = prompt[::-1], text[::-1]
    joined = reversed_prompt + "\0" + reversed_text
    z = z_function(joined)
    offset = len(reversed_prompt) + 1
    best, best_end = 0, len(text)
    for j in range(len(reversed_text)):
        shared = min(z[offset + j], len(reversed_prompt))
        if shared > best:
            best, best_end = shared, len(text) - j
    return best, best_end


def z_function(s: str) -> list[int]:
    """z[i]: the length of the longest common prefix of s and s[i:]."""
    n = len(s)
    z = [0] * n
    left = right = 0
    for i in range(1, n):
        if i < right:
            z[i] = min(right - i, z[i - left])
        while i + z[i] < n and s[z[i]] == s[i + z[i]]:
            z[i] += 1
        if i + z[i] > right:
            left, right = i, i + z[i]
    return z
