"""LoRA dropout whose mask is a function of a seed tensor, not of a random number generator's state.

`nn.Dropout` draws from the device RNG, a hidden state: on XLA a training step traced once and
replayed (finetuning_pipeline/runtime/xla/step_capture.py) cannot advance it, and activation checkpointing
restores it before recomputing a layer by making a new seed in the graph for each restore.
Here the mask is a hash of (seed, layer salt, element index), as JAX's explicit keys are: the
same seed gives the same mask on any device, in a recomputation, and in a replayed graph,
where the seed is just an input. The seed is one number, or one per sequence ([rows, 1]: each
row's mask then a hash of its own seed and the element's index within the row), which the
trainer derives from each sequence's place in the global stream of blocks (train/step.py's
dropout_seeds): a sequence draws its masks wherever it lands, whatever process or micro-batch
holds it, so any split of the global batch trains the same run (`set_dropout_seed`); without
a seed (`seed` None) the module is `nn.Dropout`'s RNG dropout.

The hash is murmur3's 32-bit finaliser on int32 tensors (XLA and PyTorch both wrap int32
products); an element is kept when its low 24 bits are at least p * 2**24, so a mask keeps
1 - p of the elements (to 2**-24), and kept ones are scaled by 1 / (1 - p), as nn.Dropout's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# murmur3 fmix32 and golden-ratio constants, as signed int32 (2246822507, 3266489909, 2654435761)
_MIX1, _MIX2, _GOLDEN = -2048144789, -1028477387, -1640531535
_BITS = 24


def _shift_right(h: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical shift of int32 values, the same on every device: `>>` of a negative int32 is
    an arithmetic shift in PyTorch and rounds toward zero on XLA, so only the non-negative low
    31 bits are shifted and the sign bit is put back where a logical shift takes it."""
    low = (h & 0x7FFFFFFF) >> bits
    return low | ((h < 0).to(torch.int32) << (31 - bits))


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ _shift_right(h, 16)
    h = h * _MIX1
    h = h ^ _shift_right(h, 13)
    h = h * _MIX2
    return h ^ _shift_right(h, 16)


def _as_data(index: torch.Tensor) -> torch.Tensor:
    """The element indices (non-negative int32) as values that torch.compile's inductor computes
    in int32, as the hash needs: the same values (`& 0x7FFFFFFF` keeps every bit of a non-negative
    int32). Multiplied straight by a constant, inductor folds the arange into an index expression
    (row * 64 * _GOLDEN + column * _GOLDEN for rows of 64) whose constants it does not wrap to
    int32, and Triton refuses the kernel ("Scalar -104994018240 is out of range for type int32",
    seen on an H100 with LoRA dropout in compiled layers); a bitwise and is an operation that
    inductor does not propagate into index expressions."""
    return index & 0x7FFFFFFF


def keep_mask(seed: torch.Tensor, salt: int | torch.Tensor, shape: torch.Size, p: float) -> torch.Tensor:
    """Boolean mask of `shape`, True where dropout keeps the element. `seed`: an int32 tensor of one
    element, or of one per row ([rows] or [rows, 1]): the mask's leading dimension is the rows
    ([rows, seq, in], or the tokens of those rows flattened, [rows * seq, in]: the same mask), each
    row's part a hash of its seed and the element's index within the row. `salt` an int, or an
    int32 tensor of one (the same mask)."""
    seed = seed.to(torch.int32).reshape(-1)
    rows = seed.shape[0]
    if rows == 1:
        key = _fmix(seed.reshape(()) * _GOLDEN + salt)
        index = torch.arange(shape.numel(), dtype=torch.int32, device=seed.device).view(shape)
    else:
        if shape.numel() % rows:
            raise ValueError(f"LoRA dropout: {rows} sequence seeds for an input of shape {tuple(shape)}")
        key = _fmix(seed * _GOLDEN + salt).view(rows, 1)
        index = torch.arange(shape.numel() // rows, dtype=torch.int32, device=seed.device).view(1, -1)
    bits = _fmix(_as_data(index) * _GOLDEN ^ key) & ((1 << _BITS) - 1)
    return (bits >= int(round(p * (1 << _BITS)))).view(shape)


class SeededDropout(nn.Module):
    """Dropout with probability p whose mask depends on (`seed`, `salt`) only; `salt` tells the
    layers apart (each LoRA layer gets its own), `seed` is set per micro-batch."""

    def __init__(self, p: float, salt: int = 0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {p}")
        self.p = p
        self.salt = salt
        self.seed: torch.Tensor | None = None
        self.register_buffer("salt_data", None, persistent=False)  # the salt as data (salt_as_data)

    def salt_as_data(self, device: torch.device) -> None:
        """Read the salt from an int32 buffer from now on, not from the int: torch.compile then
        takes it as an input of the layer's graph, which every layer shares, where an int is a
        constant of the graph and compiles each layer anew (the native runtime's compiled
        layers). The masks are the same; torch_xla's graphs keep the int as a constant."""
        self.salt_data = torch.tensor(self.salt, dtype=torch.int32, device=device)

    def forward(self, x: torch.Tensor, group: tuple[int, int] | None = None) -> torch.Tensor:
        """group (k, count): x is the k-th of `count` equal row groups of the batch (adapters side
        by side: lora_logic/layer.py), which take the k-th part of a seed per row."""
        if not self.training or self.p == 0:
            return x
        if self.seed is None:
            return F.dropout(x, self.p, training=True)
        salt = self.salt if self.salt_data is None else self.salt_data
        seed = self.seed
        if group is not None and seed.numel() > 1:
            k, count = group
            rows = seed.shape[0] // count
            seed = seed[k * rows:(k + 1) * rows]
        return x * keep_mask(seed, salt, x.shape, self.p).to(x.dtype) * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, salt={self.salt}"


def set_dropout_seed(model: nn.Module, seed: torch.Tensor | None) -> None:
    """Seed every SeededDropout in `model` (an int32 tensor on the model's device: [1], or [rows, 1]
    a seed per sequence of the batch); None
    returns them to RNG dropout. Reaches the template of scanned layers too (any module with
    `seeded_dropouts()`: finetuning_pipeline/runtime/xla/layer_scan.py)."""
    for module in model.modules():
        if isinstance(module, SeededDropout):
            module.seed = seed
        for dropout in getattr(module, "seeded_dropouts", lambda: [])():
            dropout.seed = seed
