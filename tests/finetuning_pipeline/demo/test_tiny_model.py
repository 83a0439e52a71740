"""The embedded default base model: plain transformers loads it offline; same seed, same files."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dataset.chat_template import IM_END, IM_START
from finetuning_pipeline.demo import tiny_model


def test_loads_with_plain_transformers(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    assert model.config.model_type == "mistral"
    assert model.config.vocab_size == len(tokenizer) == tiny_model.VOCAB_SIZE
    assert (tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        0, 1, 2, 3,
    )
    text = "Reședința județului Cluj este municipiul Cluj-Napoca. 🏔"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text  # byte fallback: nothing becomes <unk>
    assert tokenizer.unk_token_id not in ids
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=False).logits
    assert logits.shape == (1, len(ids), len(tokenizer))


def test_chat_template_markers_are_single_tokens(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "Răspunde scurt."},
        {"role": "user", "content": "Care este reședința județului Iași?"},
        {"role": "assistant", "content": "Iași."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<s><|im_start|>system\nRăspunde scurt.<|im_end|>\n<|im_start|>user\nCare este reședința județului "
        "Iași?<|im_end|>\n<|im_start|>assistant\nIași.<|im_end|>\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    start, end = tokenizer.convert_tokens_to_ids([IM_START, IM_END])
    assert ids.count(start) == 3 and ids.count(end) == 3
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.eos_token_id, end]


def test_same_seed_same_files_other_seed_other_weights(tmp_path, tiny_model_dir):
    again = tiny_model.write_tiny_model(tmp_path / "again", seed=0)
    names = sorted(p.name for p in tiny_model_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    for name in names:
        assert (tiny_model_dir / name).read_bytes() == (again / name).read_bytes(), name
    other = tiny_model.write_tiny_model(tmp_path / "other", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()


def test_command_line(tmp_path, capsys):
    """The command's plumbing (the default 600 pretraining steps run in `make demo`)."""
    tiny_model.main(["--out", str(tmp_path / "cli"), "--seed", "3", "--pretrain-steps", "3"])
    assert "wrote tiny Mistral model (pretrained for 3 steps)" in capsys.readouterr().out
    assert (tmp_path / "cli" / "config.json").is_file()


@pytest.mark.heavy
def test_pretraining_is_deterministic_and_learns_text_with_the_end_of_turn_marker(tmp_path):
    """A few steps of the demo base's pretraining: the same seed gives the same weights, and
    the loss falls on a stream whose documents end with the chat template's end-of-turn marker
    (LoRA, with the output layer frozen, cannot teach an untrained one)."""
    from finetuning_pipeline.demo.tiny_pretraining import pretrain, pretraining_stream

    first = tiny_model.write_tiny_model(tmp_path / "first", seed=0, pretrain_steps=12, log=lambda line: None)
    again = tiny_model.write_tiny_model(tmp_path / "again", seed=0, pretrain_steps=12, log=lambda line: None)
    assert (first / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    random_base = tiny_model.write_tiny_model(tmp_path / "random", seed=0)
    assert (first / "model.safetensors").read_bytes() != (random_base / "model.safetensors").read_bytes()

    tokenizer = AutoTokenizer.from_pretrained(random_base)
    stream = pretraining_stream(tokenizer, seed=0)
    end = tokenizer.convert_tokens_to_ids(IM_END)
    assert (stream == end).sum() > 10 and stream[0] == tokenizer.bos_token_id
    model = AutoModelForCausalLM.from_pretrained(random_base)
    losses = pretrain(model, tokenizer, steps=40, seed=0, log=lambda line: None)
    assert losses[-1] < 0.6 * losses[0]
