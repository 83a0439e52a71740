"""Pretrain the tiny demo base on the bundled domain text, so the demo fine-tunes a model that
knows some Romanian and some geography instead of random weights.

Real fine-tuning starts from a pretrained base: LoRA adapts what the base already represents.
A randomly initialised base leaves LoRA nothing to adapt (the demo then ends at an eval
perplexity of about 430 with a wrong answer). So `tiny_model` trains every weight of its model
here, in eager PyTorch on the CPU, on the phase-1 corpus only: the base learns the words and
the facts ("Județul Brașov se află în Transilvania"), never a question and its answer, which
phase 2 then teaches.

Each document (a few shuffled lines joined by newlines) is rendered by the chat template as
one assistant turn, as chat-aware bases (Qwen2.5, Gemma 3) have seen their markers. LoRA
leaves the output layer frozen: a base that never predicted `<|im_end|>` (its output row
pushed down at every step of pretraining) cannot learn to end an answer (measured: the
fine-tuned model ran on past the answer, the end marker at probability < 0.01), and one that
never saw a line start after a newline mis-predicts an answer's first token. This is the
tiny-model form of a known Llama 3 base problem: untrained chat tokens.

Deterministic: the same seed and steps give the same weights on the same machine (one fixed
batch order, no dropout).
"""

from __future__ import annotations

import json
import math
import random

import torch

from dataset.samples import DOMAIN_TEXT

LINES_PER_DOCUMENT = 8
SEQ_LEN = 128
BATCH = 16
PEAK_LR = 3e-3


def pretraining_stream(tokenizer, seed: int) -> torch.Tensor:
    """The domain corpus as one token stream: documents of LINES_PER_DOCUMENT shuffled lines,
    each rendered by the chat template as one assistant turn."""
    with open(DOMAIN_TEXT, encoding="utf-8") as f:
        lines = [json.loads(line)["text"] for line in f]
    random.Random(seed).shuffle(lines)
    documents = ["\n".join(lines[i:i + LINES_PER_DOCUMENT]) for i in range(0, len(lines), LINES_PER_DOCUMENT)]
    texts = [tokenizer.apply_chat_template([{"role": "assistant", "content": d}], tokenize=False) for d in documents]
    return torch.tensor([token for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for token in ids])


def pretrain(model: torch.nn.Module, tokenizer, steps: int, seed: int, log=print) -> list[float]:
    """Train every weight of `model` for `steps` steps of BATCH random SEQ_LEN windows of the
    stream (AdamW, cosine decay from PEAK_LR, gradients clipped at 1); returns the losses."""
    stream = pretraining_stream(tokenizer, seed)
    windows = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = PEAK_LR * 0.5 * (1 + math.cos(math.pi * step / steps))
        starts = torch.randint(0, len(stream) - SEQ_LEN, (BATCH,), generator=windows)
        batch = torch.stack([stream[s:s + SEQ_LEN] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            log(f"pretraining the tiny base: step {step + 1}/{steps}, loss {losses[-1]:.3f}")
    model.eval()
    return losses
