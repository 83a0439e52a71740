"""Preference pairs: TRL's formats, tokenized as TRL 1.16's DPOTrainer tokenizes them, cut to
one fixed shape per pair.

Formats (TRL's names), one record a pair:
  standard        {"prompt": str, "chosen": str, "rejected": str}
  conversational  {"prompt": [messages], "chosen": [one assistant message], "rejected": [one]}
  implicit prompt {"chosen": str or [messages], "rejected": the same kind}: the prompt is their
                  common beginning (TRL's `extract_prompt`, its edge cases included)

Tokenized as TRL does, so that the log-probabilities are of the same tokens:
  - conversational: the prompt rendered with the generation prompt, and prompt + each completion
    rendered whole (the tokenizer's chat template; the built-in ChatML where it has none);
  - standard: the text with the tokenizer's special tokens (its BOS), each completion ending in
    the tokenizer's EOS (appended where it does not already end so);
  and each completion is what follows the prompt's tokens both renderings share (where a template
  renders the prompt alone differently, or tokens merge across the boundary, the completion
  starts where they part: TRL's `common_prefix_length`).

The shape (`fit_pair`): the prompt keeps its last `max_prompt_len` tokens (the ones next to the
completion); then each row, prompt + completion, keeps its first `seq_len` tokens. Both rows are
padded to `seq_len`: a pair is one block, never packed with another.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dataset.chat_samples import chat_template_of
from dataset.encode import IGNORE_INDEX
from dataset.errors import InvalidRecord
from dataset.formats import ROLES, check_turn_order, require_string

SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class PreferencePair:
    """A validated record: `prompt` and the completions, all strings (standard) or all lists of
    messages (conversational)."""

    prompt: str | list[dict]
    chosen: str | list[dict]
    rejected: str | list[dict]

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)

    def chars(self) -> int:
        def size(value):
            return len(value) if isinstance(value, str) else sum(len(m["content"]) for m in value)
        return size(self.prompt) + size(self.chosen) + size(self.rejected)


def extract_prompt(chosen, rejected) -> tuple:
    """TRL's `extract_prompt`: the longest common beginning of the two (characters, or messages),
    less a space it ends with; (prompt, chosen rest, rejected rest). Kept as TRL writes it, its
    edge cases too (one a beginning of the other keeps the last shared element in the completions)."""
    index = 0
    for index in range(min(len(chosen), len(rejected))):
        if chosen[index] != rejected[index]:
            if chosen[index - 1] == " ":  # the space goes with the completion
                index -= 1
            break
    return chosen[:index], chosen[index:], rejected[index:]


def messages_of(value, field: str) -> list[dict]:
    """A list of {"role", "content"} messages, validated; InvalidRecord naming `field` otherwise."""
    if not isinstance(value, list):
        raise InvalidRecord("wrong_type", f"field {field!r} must be a string or a list of messages, "
                            f"got {type(value).__name__}")
    messages = []
    for index, turn in enumerate(value):
        where = f"{field}[{index}]."
        if not isinstance(turn, dict):
            raise InvalidRecord("wrong_type", f"{field}[{index}] must be an object, got {type(turn).__name__}")
        role = turn.get("role")
        if role not in ROLES:
            raise InvalidRecord("unknown_role", f"{where}role is {role!r}; expected one of {list(ROLES)}")
        messages.append({"role": role, "content": require_string(turn, "content", where)})
    return messages


def normalize_preference(record: dict) -> PreferencePair:
    """The pair in a record of any of the three forms; InvalidRecord saying what is wrong."""
    for field in SIDES:
        if field not in record:
            raise InvalidRecord("missing_field", f"missing field {field!r} (a preference pair has "
                                "'chosen' and 'rejected', and a 'prompt' unless it is their common beginning)")
    chosen, rejected = record["chosen"], record["rejected"]
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise InvalidRecord("wrong_type", "'chosen' and 'rejected' must be of one kind: both strings, or both "
                            "lists of messages")
    if "prompt" not in record:
        if not isinstance(chosen, str):
            chosen, rejected = messages_of(chosen, "chosen"), messages_of(rejected, "rejected")
        if chosen == rejected:
            raise InvalidRecord("chosen_equals_rejected", "'chosen' and 'rejected' are the same: no preference")
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    else:
        prompt = record["prompt"]
        if isinstance(chosen, str):
            if not isinstance(prompt, str):
                raise InvalidRecord("wrong_type", "'prompt' must be a string, as 'chosen' and 'rejected' are")
        else:
            prompt = messages_of(prompt, "prompt")
            chosen, rejected = messages_of(chosen, "chosen"), messages_of(rejected, "rejected")
    if isinstance(chosen, str):
        for field, value in zip(SIDES, (chosen, rejected)):
            if not value.strip():
                raise InvalidRecord("empty_completion", f"field {field!r} is empty (after the prompt they share)")
    else:
        check_conversation(prompt, chosen, rejected)
    if chosen == rejected:
        raise InvalidRecord("chosen_equals_rejected", "'chosen' and 'rejected' are the same: no preference")
    return PreferencePair(prompt, chosen, rejected)


def check_conversation(prompt: list[dict], chosen: list[dict], rejected: list[dict]) -> None:
    """A prompt that a user turn ends, each completion one assistant message (TRL's form)."""
    for field, completion in zip(SIDES, (chosen, rejected)):
        if not completion:
            raise InvalidRecord("empty_completion", f"field {field!r} holds no message (after the prompt they share)")
        if len(completion) != 1 or completion[0]["role"] != "assistant":
            raise InvalidRecord("bad_turn_order", f"field {field!r} must hold one assistant message, got roles "
                                f"{[m['role'] for m in completion]}")
    if not prompt:
        raise InvalidRecord("missing_field", "the prompt holds no message: a conversational pair needs a user turn")
    check_turn_order([*prompt, *chosen])


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    length = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        length += 1
    return length


def tokenize_pair(tokenizer, pair: PreferencePair) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) token ids, as TRL's DPOTrainer tokenizes the pair."""
    if pair.conversational:
        template = chat_template_of(tokenizer)

        def render(messages, generation_prompt=False):
            return list(tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True,
                                                      return_dict=True, add_generation_prompt=generation_prompt)
                        ["input_ids"])
        prompt = render(pair.prompt, generation_prompt=True)
        whole = [render(pair.prompt + completion) for completion in (pair.chosen, pair.rejected)]
    else:
        eos = tokenizer.eos_token
        completions = [text if text.endswith(eos) else text + eos for text in (pair.chosen, pair.rejected)]
        prompt = list(tokenizer(text=pair.prompt)["input_ids"])
        whole = [list(tokenizer(text=pair.prompt + completion)["input_ids"]) for completion in completions]
    shared = min(common_prefix_length(prompt, ids) for ids in whole)
    return prompt[:shared], whole[0][shared:], whole[1][shared:]


def fit_pair(prompt: list[int], chosen: list[int], rejected: list[int], seq_len: int,
             max_prompt_len: int) -> tuple[tuple[list[int], list[int], list[int]], bool]:
    """The pair cut to shape: the prompt's last `max_prompt_len` tokens, then each row's first
    `seq_len`; (prompt, chosen, rejected) and whether anything was cut. InvalidRecord
    ("empty_completion", "no_completion_left") when a completion has no token to train on."""
    if not chosen or not rejected:
        raise InvalidRecord("empty_completion", "a completion tokenizes to no token of its own")
    cut = len(prompt) > max_prompt_len
    prompt = prompt[len(prompt) - max_prompt_len:] if cut else prompt
    room = seq_len - len(prompt)
    if len(chosen) > room or len(rejected) > room:
        cut = True
        chosen, rejected = chosen[:max(room, 0)], rejected[:max(room, 0)]
    if not chosen or not rejected:
        raise InvalidRecord("no_completion_left", f"the prompt's {len(prompt)} tokens (at most --max-prompt-len "
                            f"{max_prompt_len}) leave no completion token within --seq-len {seq_len}")
    return (prompt, chosen, rejected), cut


def pair_block(prompt: list[int], chosen: list[int], rejected: list[int], seq_len: int,
               pad_id: int) -> tuple[np.ndarray, ...]:
    """The pair's four rows (in dataset/shards.py's PREFERENCE_ARRAYS order): prompt + completion from position 0,
    padded on the right with pad_id, labels on the completion only."""
    rows = []
    for completion in (chosen, rejected):
        ids = np.full(seq_len, pad_id, dtype=np.int32)
        labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int32)
        ids[:len(prompt) + len(completion)] = prompt + completion
        labels[len(prompt):len(prompt) + len(completion)] = completion
        rows += [ids, labels]
    return tuple(rows)
