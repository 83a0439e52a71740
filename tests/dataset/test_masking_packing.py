"""Loss masks cover exactly the assistant answers; packing keeps every sample whole."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from transformers import AutoTokenizer

from dataset.encode import IGNORE_INDEX, encode_conversations, encode_documents
from dataset.errors import InvalidRecord
from dataset.formats import alpaca_to_messages
from dataset.packing import BestFitPacker, StreamPacker
from dataset.samples import CHAT_QA, DOMAIN_TEXT


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def conversations():
    with open(CHAT_QA, encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f]


def test_unmasked_tokens_decode_to_exactly_the_assistant_answers(tokenizer):
    convs = conversations()
    for messages, [(ids, labels)] in zip(convs, encode_conversations(tokenizer, convs)):  # one sample each
        expected = "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")
        assert tokenizer.decode(ids[labels != IGNORE_INDEX]) == expected
        trained = labels != IGNORE_INDEX
        assert np.array_equal(labels[trained], ids[trained])  # labels are the ids themselves
        assert not trained[0]  # BOS and the whole prompt are masked


def test_every_unmasked_token_lies_inside_an_assistant_turn(tokenizer):
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Unu?"},
                {"role": "assistant", "content": "Unu."}, {"role": "user", "content": "Doi?"},
                {"role": "assistant", "content": "Doi."}]
    [[(ids, labels)]] = encode_conversations(tokenizer, [messages])
    # Walk the turns: inside a turn opened by "<|im_start|>assistant" labels may be set, nowhere else.
    in_assistant = False
    for i, token in enumerate(ids):
        if token == start:
            in_assistant = list(ids[i : i + len(header)]) == header
        if labels[i] != IGNORE_INDEX:
            assert in_assistant, i
        if token == end:
            in_assistant = False
    assert (labels == end).sum() == 2  # both answers' closing markers are trained


def test_template_that_does_not_render_incrementally_is_refused(tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = "{% for m in messages|reverse %}{{ m['content'] }}{% endfor %}"
    [refused] = encode_conversations(tokenizer, [conversations()[0]])
    assert isinstance(refused, InvalidRecord) and refused.reason == "chat_template_unlocatable"
    assert "does not render conversations incrementally" in refused.detail


def test_alpaca_becomes_a_two_turn_chat():
    assert alpaca_to_messages({"instruction": "Tradu.", "input": "casă", "output": "house"}) == [
        {"role": "user", "content": "Tradu.\n\ncasă"},
        {"role": "assistant", "content": "house"},
    ]
    assert alpaca_to_messages({"instruction": "Spune da.", "output": "Da."})[0]["content"] == "Spune da."


def test_best_fit_keeps_conversations_whole_and_restarts_positions(tokenizer):
    encoded = [sample for samples in encode_conversations(tokenizer, conversations()) for sample in samples]
    packer = BestFitPacker(seq_len=512, pad_id=tokenizer.pad_token_id, max_open=8)
    blocks = [b for s in encoded for b in packer.add(*s)] + list(packer.flush())
    segments = Counter()
    real_total = 0
    for (ids, labels, positions), real in blocks:
        assert ids.shape == labels.shape == positions.shape == (512,)
        starts = list(np.flatnonzero(positions == 0)) + [512]
        for a, b in zip(starts, starts[1:]):
            assert np.array_equal(positions[a:b], np.arange(b - a))
            if a < real:
                segments[(tuple(ids[a:b]), tuple(labels[a:b]))] += 1
        assert np.all(ids[real:] == tokenizer.pad_token_id) and np.all(labels[real:] == IGNORE_INDEX)
        real_total += real
    # Every conversation appears exactly once, whole, as one segment.
    assert segments == Counter((tuple(ids), tuple(labels)) for ids, labels in encoded)
    fill = real_total / (len(blocks) * 512)
    assert fill >= 0.90, fill


def test_stream_packing_keeps_every_token_in_order(tokenizer):
    with open(DOMAIN_TEXT, encoding="utf-8") as f:
        docs = encode_documents(tokenizer, [json.loads(line)["text"] for line in f][:40])
    packer = StreamPacker(seq_len=100, pad_id=tokenizer.pad_token_id)
    blocks = [b for d in docs for b in packer.add(d)] + list(packer.flush())
    stream = np.concatenate([ids[:real] for (ids, _, _), real in blocks])
    assert np.array_equal(stream, np.concatenate(docs))
    (last_ids, last_labels, _), last_real = blocks[-1]
    assert np.all(last_labels[last_real:] == IGNORE_INDEX)
    assert all(real == 100 for _, real in blocks[:-1])
    assert docs[0][0] == tokenizer.bos_token_id and docs[0][-1] == tokenizer.eos_token_id


def test_packer_refuses_an_overlong_sample():
    packer = BestFitPacker(seq_len=8, pad_id=0)
    with pytest.raises(ValueError, match="longer than seq_len 8"):
        list(packer.add(np.zeros(9, np.int32), np.zeros(9, np.int32)))


def test_fast_renderer_matches_apply_chat_template(tokenizer):
    from dataset.chat_samples import ChatRenderer

    render = ChatRenderer(tokenizer)
    assert render.compiled is not None  # the fast path is really in use on the pinned stack
    for messages in conversations():
        for cut in range(1, len(messages) + 1):
            for generation_prompt in (False, True):
                assert render(messages[:cut], generation_prompt) == tokenizer.apply_chat_template(
                    messages[:cut], tokenize=False, add_generation_prompt=generation_prompt
                )
    assert render.compiled is not None  # and it never fell back


def test_renderer_falls_back_when_the_fast_path_disagrees(tokenizer):
    from dataset.chat_samples import ChatRenderer

    render = ChatRenderer(tokenizer)
    render.context = {**render.context, "bos_token": "<wrong>"}
    messages = conversations()[0]
    assert render(messages, False) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert render.compiled is None
