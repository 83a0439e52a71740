"""The attention masks of a training forward: each layer type gets the mask it was trained with.

We always pass transformers an explicit mask: without one, transformers 5 derives positions and
probes them for packed sequences with a Python branch on a tensor (a host sync every forward
on XLA, and a graph that depends on the data). But transformers uses a custom 4D mask as-is for
every layer, so one mask would silently drop the sliding window of local-attention layers
(Gemma 2/3, Mistral v0.1, Phi-3, Qwen2/3 with sliding layers): they would attend to the whole
sequence in training and to their window at inference. So:
- models whose config lists `layer_types` (Gemma 2/3, Qwen2/3, ...) take a dict
  {layer type: 4D mask}, one mask per type, as their forward accepts;
- models without `layer_types` apply `config.sliding_window`, when set, to every layer
  (Mistral, Mixtral, Phi-3, Starcoder2): one 4D mask with the window built in.

Window semantics are transformers' (`masking_utils.sliding_window_overlay`): query q sees key k
when 0 <= q - k < window. Packed blocks (phase 2) restart `position_ids` at 0 for each sample;
a token sees only its own sample's earlier tokens. Everything is built on the device from
`position_ids` and `arange`: no host sync, the same graph every step.
"""

from __future__ import annotations

import torch

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
ONE_MASK = ""  # the key of `mask_windows` for models that take a single mask


def mask_windows(config) -> dict[str, int | None]:
    """{layer type: sliding window or None for full attention} of a Hugging Face config;
    {ONE_MASK: window} for models that take one mask for every layer. Raises ValueError for a
    layer type we do not build (e.g. Llama 4's chunked attention)."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if not layer_types:
        return {ONE_MASK: window}
    unknown = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unknown:
        raise ValueError(f"{type(config).__name__}: layer types {unknown} are not supported (we build masks for "
                         f"{list(SUPPORTED_LAYER_TYPES)}); training would give those layers the wrong mask")
    if "sliding_attention" in layer_types and not window:
        raise ValueError(f"{type(config).__name__}: sliding_attention layers but no sliding_window in the config")
    return {t: (window if t == "sliding_attention" else None) for t in sorted(set(layer_types))}


def allowed_positions(length: int, device, window: int | None, position_ids: torch.Tensor | None) -> torch.Tensor:
    """Boolean [B or 1, 1, L, L]: True where query i may attend to key j."""
    index = torch.arange(length, device=device)
    distance = index[:, None] - index[None, :]  # q - k, [L, L]
    allowed = distance >= 0
    if window is not None:
        allowed = allowed & (distance < window)
    if position_ids is None:
        return allowed[None, None]  # one stream of text: the same for every row
    segment = torch.cumsum((position_ids == 0).to(torch.int32), dim=-1)  # [B, L], a new sample at each 0
    same_segment = segment[:, :, None] == segment[:, None, :]  # [B, L, L]
    return (same_segment & allowed)[:, None]


def as_attention_mask(allowed: torch.Tensor, dtype: torch.dtype, sdpa: bool) -> torch.Tensor:
    """sdpa takes a boolean mask (True = attend); eager attention adds a float one."""
    if sdpa:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def attention_masks(config, length: int, device, dtype: torch.dtype, position_ids: torch.Tensor | None = None):
    """What to pass as `attention_mask`: one 4D mask, or a dict of them by layer type.
    position_ids: the packed layout (None: each row is one stream of text, positions 0..L-1)."""
    sdpa = getattr(config, "_attn_implementation", "sdpa") == "sdpa"
    windows = mask_windows(config)
    built: dict[int | None, torch.Tensor] = {}  # layer types with the same window share a mask
    for window in windows.values():
        if window not in built:
            built[window] = as_attention_mask(allowed_positions(length, device, window, position_ids), dtype, sdpa)
    if ONE_MASK in windows:
        return built[windows[ONE_MASK]]
    return {layer_type: built[window] for layer_type, window in windows.items()}
