"""Loss masks under the public chat templates of the families our users fine-tune.

The templates (tests/chat_templates/) are the published `chat_template`s of Llama 3
(Meta-Llama-3-8B-Instruct), Gemma 3 (gemma-3-*-it), Mistral v0.1 and v0.3
(Mistral-7B-Instruct-v0.1/-v0.3), Qwen2.5 (Qwen2.5-*-Instruct) and Qwen3, each on a tiny
tokenizer trained here on the bundled text with that family's special tokens (byte-level BPE
for Llama and Qwen, a sentencepiece-style "▁" vocabulary for Mistral and Gemma).

What must hold for every template: each answer is trained exactly as the template renders it
when the model writes it (after `render(history, add_generation_prompt=True)`, what the
template appends for it as the last turn, including its end-of-turn token), nothing else is;
at most one BOS per sample; an answer's trained tokens are the same whether its conversation
has one turn or several. The expected answer renderings below are written from the templates'
definitions, not computed by the code under test.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from dataset import prepare
from dataset.chat_samples import ChatRenderer, training_samples
from dataset.encode import IGNORE_INDEX, encode_conversations
from dataset.errors import InvalidRecord
from dataset.samples import iter_sample_texts

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"


def split_reasoning(content: str) -> tuple[str, str]:
    """Qwen3's reading of an answer: (reasoning, answer) around "</think>"."""
    if "</think>" not in content:
        return "", content
    reasoning, answer = content.split("</think>")[0], content.split("</think>")[-1]
    return reasoning.rstrip("\n").split("<think>")[-1].lstrip("\n"), answer.lstrip("\n")


def qwen3_answer(content: str) -> str:
    reasoning, answer = split_reasoning(content)
    return "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + answer + "<|im_end|>"


# family: (tokenizer style, special tokens, bos, eos, whether a system turn is supported,
#          the answer as the template renders it last, from its definition)
FAMILIES = {
    "llama3": ("bytes", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>", True,
               lambda content: content.strip() + "<|eot_id|>"),
    "gemma3": ("pieces", ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", True,
               lambda content: content.strip() + "<end_of_turn>"),
    "mistral_v0.1": ("pieces", ["<unk>", "<s>", "</s>"], "<s>", "</s>", False,
                     lambda content: content + "</s>"),
    "mistral_v0.3": ("pieces", ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", True,
                     lambda content: " " + content.strip() + "</s>"),
    "qwen2.5": ("bytes", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", True,
                lambda content: content + "<|im_end|>"),
    "qwen3": ("bytes", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], None, "<|im_end|>",
              True, qwen3_answer),
}


def tiny_tokenizer(family: str) -> PreTrainedTokenizerFast:
    style, specials, bos, eos, _, _ = FAMILIES[family]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>" if "<unk>" in specials else None))
    if style == "bytes":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        alphabet = list(string.printable)  # sentencepiece vocabularies cover these (Gemma, Mistral: byte fallback)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)
    tokenizer.train_from_iterator(iter_sample_texts(), trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos,
                                      unk_token="<unk>" if "<unk>" in specials else None,
                                      pad_token=specials[0])
    wrapped.chat_template = (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")
    return wrapped


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param, tiny_tokenizer(request.param)


SYSTEM = {"role": "system", "content": "Răspunde scurt, în limba română."}
EXCHANGES = [
    ("Care este reședința județului Cluj?", "Reședința județului Cluj este municipiul Cluj-Napoca."),
    ("În ce regiune se află județul Iași?", "  Județul Iași se află în Moldova.\n"),  # spaces the template may trim
    ("Și județul Tulcea?", "<think>\nTulcea este lângă Delta Dunării.\n</think>\n\nÎn Dobrogea."),
]


def conversation(exchanges, system: bool) -> list[dict]:
    turns = [SYSTEM] if system else []
    for question, answer in exchanges:
        turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return turns


def expected_answer(family: str, content: str) -> str:
    return FAMILIES[family][5](content)


def trained_runs(labels: np.ndarray) -> list[tuple[int, int]]:
    """The token ranges of each maximal run of trained tokens in a sample."""
    runs, start = [], None
    for i, trained in enumerate(list(labels != IGNORE_INDEX) + [False]):
        if trained and start is None:
            start = i
        if not trained and start is not None:
            runs.append((start, i))
            start = None
    return runs


def answers_as_trained(tokenizer, messages: list[dict]) -> list[tuple[str, str, list[int]]]:
    """For each trained run of every sample: (the text before it, its text, its token ids)."""
    render = ChatRenderer(tokenizer)
    samples = training_samples(render, messages)
    [encoded] = encode_conversations(tokenizer, [messages], render)
    assert len(samples) == len(encoded)
    found = []
    for (text, _), (ids, labels) in zip(samples, encoded):
        tokens = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ids.tolist() == tokens["input_ids"]
        if tokenizer.bos_token_id is not None:
            assert (ids == tokenizer.bos_token_id).sum() <= 1  # at most one BOS per sample
        offsets = tokens["offset_mapping"]
        for first, last in trained_runs(labels):
            start, end = offsets[first][0], offsets[last - 1][1]
            found.append((text[:start], text[start:end], ids[first:last].tolist()))
    return found


@pytest.mark.parametrize("system", [False, True])
def test_every_answer_is_trained_as_the_template_renders_it_and_nothing_else(family, system):
    name, tokenizer = family
    if system and not FAMILIES[name][4]:
        pytest.skip(f"{name}'s template refuses a system turn (tested below)")
    messages = conversation(EXCHANGES, system)
    found = answers_as_trained(tokenizer, messages)
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert len(found) == len(answers)
    for (before, text, _), index in zip(found, answers):
        assert text == expected_answer(name, messages[index]["content"]), (name, index)
        # Trained after exactly what the model is given when it writes this answer: the
        # template's generation prompt for its history (Mistral v0.3: the system turn in the
        # last user turn, though the template drops it once that turn is no longer last).
        prompt = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
        assert before == prompt, (name, index)


@pytest.mark.parametrize("system", [False, True])
def test_an_answer_trains_the_same_tokens_in_one_turn_or_several(family, system):
    name, tokenizer = family
    if system and not FAMILIES[name][4]:
        pytest.skip(f"{name}'s template refuses a system turn")
    several = [ids for _, _, ids in answers_as_trained(tokenizer, conversation(EXCHANGES, system))]
    alone = [answers_as_trained(tokenizer, conversation([exchange], system))[0][2] for exchange in EXCHANGES]
    assert several == alone


def test_the_bundled_conversations_under_every_template(family):
    name, tokenizer = family
    with open(Path(prepare.__file__).parent / "samples" / "chat_qa.jsonl", encoding="utf-8") as f:
        conversations = [json.loads(line)["messages"] for line in f]
    if not FAMILIES[name][4]:
        conversations = [[m for m in c if m["role"] != "system"] for c in conversations]
    for messages in conversations[:60]:
        found = answers_as_trained(tokenizer, messages)
        expected = [expected_answer(name, m["content"]) for m in messages if m["role"] == "assistant"]
        assert [text for _, text, _ in found] == expected


def test_qwen3_trains_the_reasoning_it_keeps_and_one_sample_per_answer():
    tokenizer = tiny_tokenizer("qwen3")
    messages = conversation(EXCHANGES, True)
    samples = training_samples(ChatRenderer(tokenizer), messages)
    assert len(samples) == 3  # earlier answers lose their <think> block in later turns' history
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "<think>\n\n</think>\n\nReședința" not in full  # the history as the model will see it...
    first_text, [(start, end)] = samples[0]
    assert first_text[start:end] == "<think>\n\n</think>\n\nReședința județului Cluj este municipiul Cluj-Napoca." \
                                    "<|im_end|>"  # ...and the answer as it was written
    last_text, [(start, end)] = samples[2]
    assert last_text[start:end].startswith("<think>\nTulcea este lângă Delta Dunării.\n</think>\n\n")


def test_incremental_templates_keep_one_sample_per_conversation():
    for name in ("llama3", "gemma3", "mistral_v0.1", "qwen2.5"):
        tokenizer = tiny_tokenizer(name)
        messages = conversation(EXCHANGES, FAMILIES[name][4])
        assert len(training_samples(ChatRenderer(tokenizer), messages)) == 1, name


def test_a_conversation_the_template_refuses_is_skipped_and_counted_with_skip_invalid(tmp_path):
    tokenizer = tiny_tokenizer("mistral_v0.1")
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    data = tmp_path / "chat.jsonl"
    good, with_system = conversation(EXCHANGES[:1], system=False), conversation(EXCHANGES[:1], system=True)
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in [good, with_system, good]), encoding="utf-8")
    args = ["--input", str(data), "--tokenizer", str(tmp_path / "tokenizer"), "--seq-len", "128",
            "--eval-fraction", "0"]
    assert prepare.main([*args, "--out", str(tmp_path / "strict")]) == 2
    assert not (tmp_path / "strict").exists()
    assert prepare.main([*args, "--out", str(tmp_path / "lenient"), "--skip-invalid"]) == 0
    stats = json.loads((tmp_path / "lenient" / "stats.json").read_text())
    assert stats["records"]["kept"] == 2 and stats["records"]["skipped_by_reason"] == {"chat_template_refused": 1}


def test_refusals_name_the_file_line_and_what_to_do(tmp_path, capsys):
    tokenizer = tiny_tokenizer("mistral_v0.1")
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": conversation(EXCHANGES[:1], system=False)}) + "\n"
                    + json.dumps({"messages": conversation(EXCHANGES[:1], system=True)}) + "\n", encoding="utf-8")
    code = prepare.main(["--input", str(data), "--tokenizer", str(tmp_path / "tokenizer"), "--seq-len", "128",
                         "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    # Mistral v0.1 has no system turn: its alternation check refuses one first.
    assert f"{data}:2: the chat template refused this conversation (Conversation roles must alternate " in err
    assert "no system turn" in err


def test_qwen3_multi_turn_data_prepares_one_sample_per_answer(tmp_path, capsys):
    tokenizer = tiny_tokenizer("qwen3")
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": conversation(EXCHANGES, True)}) + "\n"
                    + json.dumps({"messages": conversation(EXCHANGES[:1], False)}) + "\n", encoding="utf-8")
    code = prepare.main(["--input", str(data), "--tokenizer", str(tmp_path / "tokenizer"), "--seq-len", "256",
                         "--eval-fraction", "0", "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["records"]["kept"] == 2 and stats["samples"] == 4
    assert "samples: 4 (one per answer" in capsys.readouterr().out


def test_a_template_whose_answers_do_not_follow_its_generation_prompt_is_refused_not_mis_masked():
    """Like DeepSeek-R1's later template: the generation prompt opens a <think> block that the
    rendered answers never have, so no text shows what the model writes after that prompt."""
    tokenizer = tiny_tokenizer("qwen3")
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}"
        "{{ '<|im_start|>user\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% else %}{% set content = m['content'].split('</think>')[-1] %}"
        "{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
    )
    [refused] = encode_conversations(tokenizer, [conversation(EXCHANGES[:2], False)])
    assert isinstance(refused, InvalidRecord) and refused.reason == "chat_template_unlocatable"
    assert "messages[1] cannot be located" in refused.detail and "generation prompt" in refused.detail


def test_an_overlong_answer_sample_is_counted_not_silently_dropped(tmp_path):
    """One sample per answer: a long conversation's later samples can outgrow seq_len while its
    first fits. The record is kept, and each dropped sample is counted with its reason."""
    tokenizer = tiny_tokenizer("qwen3")
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    messages = conversation(EXCHANGES, True)
    [samples] = encode_conversations(tokenizer, [messages])
    lengths = [len(ids) for ids, _ in samples]
    assert lengths == sorted(lengths) and lengths[0] < lengths[1]
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": messages}) + "\n", encoding="utf-8")
    assert prepare.main(["--input", str(data), "--tokenizer", str(tmp_path / "tokenizer"), "--seq-len",
                         str(lengths[0]), "--overlong", "drop", "--eval-fraction", "0", "--out",
                         str(tmp_path / "out")]) == 0
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["records"]["kept"] == 1 and stats["samples"] == 1
    assert stats["samples_skipped"] == {"overlong_dropped": 2}


def test_preference_pairs_tokenize_as_trl_tokenizes_them_under_every_template(family):
    """Each template's pairs, conversational (a multi-turn prompt) and standard, are the tokens
    TRL 1.16's DPOTrainer._prepare_dataset makes of them (dataset/preference.py), prompt and both
    completions, where the template renders the prompt alone otherwise than before an answer too."""
    from types import SimpleNamespace

    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from dataset.preference import normalize_preference, tokenize_pair

    name, tokenizer = family
    (q1, a1), (q2, a2), _ = EXCHANGES
    records = [
        {"prompt": [{"role": "user", "content": q1}, {"role": "assistant", "content": a1},
                    {"role": "user", "content": q2}],
         "chosen": [{"role": "assistant", "content": "Județul Iași se află în Moldova."}],
         "rejected": [{"role": "assistant", "content": "Județul Iași se află în Oltenia."}]},
        {"prompt": q1, "chosen": " Cluj-Napoca.", "rejected": " Turda."},
    ]
    args = DPOConfig(output_dir="unused", max_length=None, report_to=[], dataset_num_proc=None)
    for record in records:
        theirs = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tokenizer), Dataset.from_list([record]),
                                             tokenizer, args, "train")[0]
        ours = tokenize_pair(tokenizer, normalize_preference(record))
        assert ours == (theirs["prompt_ids"], theirs["chosen_ids"], theirs["rejected_ids"]), name
        assert ours[1] != ours[2]
