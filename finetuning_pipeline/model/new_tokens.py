"""New tokens' rows in a model's embeddings (model.new_tokens): made where the model has none,
and set to the mean of the rows of the tokenizer's own tokens.

A tokenizer extended with new tokens (utils/tokenizer_loading.add_new_tokens) numbers them after
its vocabulary. The model needs a row for each in its input embedding and output layer: where
its matrices are shorter, they grow (`resize_token_embeddings`); where they already have rows
there (a vocabulary padded to a multiple, as Qwen2's), those unused rows are taken. Either way
the new rows start at the mean of the existing tokens' rows, the centre transformers'
`mean_resizing` draws around, without its random draw: every process, every resume and every
later load (export, evaluate) must build the same rows, since only the trained rows are saved
(lora.trainable_token_indices) or the whole matrices (lora.modules_to_save).
"""

from __future__ import annotations

import torch


def add_token_rows(model, first_new: int, count: int) -> None:
    """Rows first_new .. first_new + count - 1 of the input embedding (and of an untied output
    layer) set to the mean of rows 0 .. first_new - 1, the matrices grown to hold them if needed."""
    if count <= 0:
        return
    needed = first_new + count
    embedding = model.get_input_embeddings()
    if embedding.weight.shape[0] < needed:
        model.resize_token_embeddings(needed, mean_resizing=False)
        embedding = model.get_input_embeddings()
    matrices = [embedding.weight]
    head = model.get_output_embeddings()
    if head is not None and head.weight is not embedding.weight:
        matrices.append(head.weight)
    with torch.no_grad():
        for weight in matrices:
            mean = weight[:first_new].to(torch.float64).mean(0)
            weight[first_new:needed] = mean.to(weight.dtype)


def tokenizer_beside(directory) -> bool:
    """Whether `directory` (an adapter's) holds a tokenizer: the one it was trained with, when
    model.new_tokens extended the base's (train/phase_loop.py writes it there)."""
    from pathlib import Path

    from utils.tokenizer_loading import TOKENIZER_FILES

    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def token_rows_of(tokenizer_dir, adapters) -> tuple[int, int] | None:
    """(first new id, how many) the base needs for `adapters`: the last one holding a tokenizer
    longer than the base's (tokenizer_dir's) was trained with those rows; None where none does."""
    from utils.tokenizer_loading import load_tokenizer

    extended = [a for a in adapters if tokenizer_beside(a)]
    if not extended:
        return None
    base = len(load_tokenizer(tokenizer_dir, "the base's tokenizer"))
    longest = len(load_tokenizer(extended[-1], f"the tokenizer beside adapter {extended[-1]}"))
    return (base, longest - base) if longest > base else None


def serving_tokenizer(base, adapters, given=None) -> tuple[str, str]:
    """(directory, how it was named) of the tokenizer that reads the model `base` + `adapters`:
    `given` (--tokenizer), else the last adapter's own (one trained with new tokens holds it),
    else the base's."""
    if given:
        return str(given), "--tokenizer"
    extended = [a for a in adapters if tokenizer_beside(a)]
    return (str(extended[-1]), f"the tokenizer beside --adapter {extended[-1]}") if extended else (str(base), "--model")
