"""`TrainableTokens`: some rows of the embeddings trained beside the LoRA (PEFT's
`trainable_token_indices`): new tokens' rows, at a fraction of a full copy's memory.

A model given new tokens (a new language's words, special tokens) has to learn their input
embeddings and output rows; training the whole matrices (modules_to_save) costs a copy and its
AdamW state of 32k-262k rows to learn a few. Here only the listed rows train: each wrapped module
keeps its frozen original and an adapter's values of those rows, PEFT's layout (a
`TrainableTokensWrapper` holding `token_adapter.trainable_tokens_delta[<adapter>]` [rows, hidden],
despite its name the rows' values, not a difference, starting at the original rows), so a saved
adapter names them "<module path>.token_adapter.trainable_tokens_delta". The forward is the
original module's with its weight's listed rows replaced (`index_copy`, as PEFT computes it).

`lora.trainable_token_indices`: a list of token ids (the input embedding's rows: PEFT's meaning),
or {module name: ids} (e.g. the output layer's too). A tied output layer shares the input
embedding's rows (one trainable tensor, saved once, as PEFT ties them).
"""

from __future__ import annotations

import torch
from torch import nn

from lora_logic.config import matches_target
from lora_logic.modules_to_save import ModuleAdapter, tied_output_layer
from utils.precision import at_least_fp32

DELTAS = "trainable_tokens_delta"  # PEFT's names (peft/tuners/trainable_tokens/layer.py)
TOKEN_ADAPTER = "token_adapter"


class TokenRows(nn.Module):
    """The trained rows of each adapter: `trainable_tokens_delta[<adapter>]` [rows, hidden] (at
    least fp32) and their row numbers (`token_indices[<adapter>]`, and as a buffer on the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.trainable_tokens_delta = nn.ParameterDict()
        self.token_indices: dict[str, list[int]] = {}

    def index(self, adapter: str) -> torch.Tensor:
        return getattr(self, f"index_{adapter}")

    def add(self, adapter: str, indices: list[int], values: torch.Tensor, trainable: bool) -> None:
        self.token_indices[adapter] = list(indices)
        self.register_buffer(f"index_{adapter}", torch.tensor(indices, dtype=torch.long, device=values.device),
                             persistent=False)
        self.trainable_tokens_delta[adapter] = nn.Parameter(at_least_fp32(values).clone(), requires_grad=trainable)


class TrainableTokens(ModuleAdapter):
    """An embedding (or output layer) whose listed rows an adapter trains (see above)."""

    def __init__(self, original: nn.Module, adapters: list[str]) -> None:
        super().__init__(original, adapters)
        self.token_adapter = TokenRows()

    def add_adapter(self, name: str, indices: list[int]) -> None:
        weight = self.original_module.weight
        bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < weight.shape[0]]
        if bad or not indices or len(set(indices)) != len(indices):
            raise ValueError(f"lora.trainable_token_indices: {list(indices)[:8]} must be distinct token ids in "
                             f"[0, {weight.shape[0]}) (the module's rows){f'; not {bad[:5]}' if bad else ''}")
        with torch.no_grad():
            self.token_adapter.add(name, indices, weight[torch.tensor(indices)], trainable=True)

    def tie_to(self, embedding: TrainableTokens) -> None:
        """Share the input embedding's rows (a tied output layer: one weight, one set of rows)."""
        self.token_adapter = embedding.token_adapter
        self._tied_to = [embedding]

    def add_frozen_copy(self, source: str, name: str) -> None:
        """Adapter `name`: a frozen copy of adapter `source`'s rows (a preference phase's reference)."""
        if self.tied_to is not None:
            return  # the rows are its embedding's, copied there
        rows = self.token_adapter
        if name in rows.trainable_tokens_delta:
            raise ValueError(f"adapter {name!r}: already here")
        with torch.no_grad():
            rows.add(name, rows.token_indices[source], rows.trainable_tokens_delta[source].detach(), trainable=False)

    def adapter_weights(self, name: str) -> dict[str, torch.Tensor] | None:
        rows = self.token_adapter
        if name not in rows.trainable_tokens_delta:
            return None
        weight = self.original_module.weight
        return {"weight": weight.index_copy(0, rows.index(name), rows.trainable_tokens_delta[name].to(weight.dtype))}

    def saved_weights(self, name: str) -> dict[str, torch.Tensor]:
        """Adapter `name`'s rows as PEFT saves them (a tied output layer's are its embedding's: none)."""
        rows = self.token_adapter
        if self.tied_to is not None or name not in rows.trainable_tokens_delta:
            return {}
        return {f"{TOKEN_ADAPTER}.{DELTAS}": rows.trainable_tokens_delta[name].detach()}


def token_rows_by_module(model: nn.Module, indices: list[int] | dict[str, list[int]]) -> dict[str, list[int]]:
    """{module name: its rows} of `lora.trainable_token_indices`: a list is the input embedding's
    rows (PEFT's meaning), a mapping names modules by suffix (each must match one module)."""
    named = [name for name, _ in model.named_modules() if name]
    if not isinstance(indices, dict):
        embedding = model.get_input_embeddings()
        return {next(n for n, m in model.named_modules() if m is embedding): list(indices)}
    chosen = {}
    for wanted, rows in indices.items():
        found = [n for n in named if matches_target(n, wanted)]
        if len(found) != 1:
            raise ValueError(f"lora.trainable_token_indices: {wanted!r} matches {len(found)} modules of "
                             f"{type(model).__name__} ({found[:3]}); name one (e.g. embed_tokens, lm_head)")
        chosen[found[0]] = list(rows)
    return chosen


def wrap_trainable_tokens(model: nn.Module, indices: list[int] | dict[str, list[int]], adapter: str) -> list[str]:
    """Wrap the modules `indices` names (token_rows_by_module) in TrainableTokens for `adapter`;
    a tied output layer shares the input embedding's rows (its own listed rows, if any, must be
    the same). Returns the wrapped names."""
    rows = token_rows_by_module(model, indices)
    tied = tied_output_layer(model)
    if tied and tied[0] in rows and tied[1] in rows and rows[tied[0]] != rows[tied[1]]:
        raise ValueError(f"lora.trainable_token_indices: {tied[0]} and {tied[1]} are one tied weight; give them the "
                         "same rows (or list the embedding's alone: the output layer shares them)")
    if tied and tied[1] in rows and tied[0] not in rows:
        rows = {tied[0]: rows.pop(tied[1]), **rows}
    wrapped: dict[str, TrainableTokens] = {}
    for name in [n for n, _ in model.named_modules() if n in rows or (tied and n == tied[1] and tied[0] in rows)]:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        original = getattr(parent, child)
        if isinstance(original, ModuleAdapter):
            raise ValueError(f"lora.trainable_token_indices: {name} is in lora.modules_to_save too (trained whole); "
                             "train it whole or by rows, not both")
        if not isinstance(getattr(original, "weight", None), torch.Tensor) or original.weight.dim() != 2:
            raise ValueError(f"lora.trainable_token_indices: {name} is no embedding or output layer (a 2-D weight)")
        wrapper = TrainableTokens(original, [adapter])
        wrapper.train(original.training)
        if tied and name == tied[1]:
            wrapper.tie_to(wrapped[tied[0]])
        else:
            wrapper.add_adapter(adapter, rows[name])
        setattr(parent, child, wrapper)
        wrapped[name] = wrapper
    return list(wrapped)
