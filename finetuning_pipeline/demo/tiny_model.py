"""Build the embedded default base model: a tiny Mistral with a tokenizer trained on our samples.

    python -m finetuning_pipeline.demo.tiny_model --out outputs/demo/base [--seed 0]

No network: a sentencepiece BPE tokenizer is trained on the bundled corpora
(`dataset/samples/`), and a Mistral-architecture model (2 layers, hidden 64, GQA 4:2) is
initialised from the seed, then pretrained on the bundled domain text (as chat-template turns)
for `--pretrain-steps`
(default 600, about half a minute on 2 cores; 0 keeps the random weights, as the tests do:
see tiny_pretraining.py). The result is a normal Hugging Face model directory
(config.json, model.safetensors, tokenizer files with a ChatML chat template) that
`AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load
offline. The same seed and steps give the same files, byte for byte, on the same machine.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path

import sentencepiece as spm
import torch
from transformers import GenerationConfig, LlamaTokenizer, MistralConfig, MistralForCausalLM

from dataset.chat_template import CHATML_TEMPLATE, IM_END, IM_START
from dataset.samples import iter_sample_texts
from finetuning_pipeline.demo.tiny_pretraining import pretrain
from finetuning_pipeline.errors import run_command
from utils.cli_types import non_negative_int
from utils.output_guard import claim_output, mark_written_by, staged_directory

COMMAND = "finetuning_pipeline.demo.tiny_model"
VOCAB_SIZE = 1024
PRETRAIN_STEPS = 600  # the domain text's loss is ~0.06 by then: the base knows it
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"


def train_sentencepiece(vocab_size: int = VOCAB_SIZE) -> bytes:
    """A sentencepiece BPE model (serialized) trained on the bundled sample texts.

    Ids 0-3 are <unk>, <s>, </s>, <pad>; the ChatML markers are single tokens; byte
    fallback means any UTF-8 text encodes without <unk>. One thread, so it is deterministic.
    """
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sorted(set(iter_sample_texts()))),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=1.0,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        unk_piece=UNK,
        bos_piece=BOS,
        eos_piece=EOS,
        pad_piece=PAD,
        user_defined_symbols=[IM_START, IM_END],
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def build_tokenizer(sp_model: bytes) -> LlamaTokenizer:
    """A transformers tokenizer over `sp_model` with our special tokens and chat template.

    transformers 5.x: building `LlamaTokenizerFast(vocab_file=...)` directly silently yields a
    3-token vocabulary, so the model goes into a folder as `tokenizer.model` and is loaded
    with `from_pretrained`, which converts it properly.
    """
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "tokenizer.model").write_bytes(sp_model)
        tokenizer = LlamaTokenizer.from_pretrained(
            folder,
            unk_token=UNK,
            bos_token=BOS,
            eos_token=EOS,
            pad_token=PAD,
            additional_special_tokens=[IM_START, IM_END],
        )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


# The tiny model's shape (benchmarks build it without its tokenizer): grouped-query attention,
# as in Mistral 7B (32:8).
TINY_DIMENSIONS = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 16}


def tiny_mistral_config(tokenizer: LlamaTokenizer) -> MistralConfig:
    """A 2-layer Mistral small enough to train in minutes on 2 CPU cores (about 0.23M parameters)."""
    return MistralConfig(
        vocab_size=len(tokenizer),
        **TINY_DIMENSIONS,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        sliding_window=None,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )


def write_tiny_model(out: str | Path, seed: int = 0, pretrain_steps: int = 0, log=print) -> Path:
    """Write the tokenizer and a tiny Mistral, initialised from `seed` and pretrained for
    `pretrain_steps`, to `out`, which appears only when complete (an existing `out` is
    replaced: claim it first, as `main` does); returns `out`."""
    out = Path(out)
    tokenizer = build_tokenizer(train_sentencepiece())
    torch.manual_seed(seed)
    model = MistralForCausalLM(tiny_mistral_config(tokenizer)).to(torch.float32)
    if pretrain_steps:
        pretrain(model, tokenizer, pretrain_steps, seed, log)
    # Chat generation stops at the end of the assistant's turn as well as at </s>.
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    )
    with staged_directory(out) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        mark_written_by(staging, COMMAND)
    return out


def main(argv: list[str] | None = None) -> int:
    return run_command(tiny_model_command, argv)


def tiny_model_command(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        description="Write a tiny Mistral-architecture model + tokenizer trained on the bundled corpora "
        "(the demo's base model; no network needed)."
    )
    parser.add_argument("--out", required=True, help="output directory (a Hugging Face model directory)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weight init and pretraining (default: 0)")
    parser.add_argument("--pretrain-steps", type=non_negative_int, default=PRETRAIN_STEPS,
                        help=f"steps of pretraining on the bundled domain text (default {PRETRAIN_STEPS}; "
                             "0: random weights)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out that this command wrote")
    args = parser.parse_args(argv)
    claim_output(args.out, force=args.force, command=COMMAND)
    out = write_tiny_model(args.out, args.seed, args.pretrain_steps)
    state = f"pretrained for {args.pretrain_steps} steps" if args.pretrain_steps else "random weights"
    print(f"wrote tiny Mistral model ({state}) and tokenizer to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
