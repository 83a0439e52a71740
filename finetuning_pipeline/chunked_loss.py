"""Next-token cross-entropy that never holds the full logits.

The full path builds [tokens, vocab] logits and an fp32 copy: with Gemma's 262,144-token
vocabulary, 2 x 1024 tokens are 2 GiB per fp32 copy, and the backward keeps several. Here the
decoder's last hidden states [tokens, hidden] are cut into chunks of tokens; each chunk goes
through the output projection, the model's own final-logit processing (soft-capping, logit
scaling) and the loss in fp32, and under autograd each chunk is checkpointed, so its logits
are recomputed in the backward instead of stored (torchtune's chunked-output loss and
Levanter's blockwise loss are the references). At most one chunk's logits exist at a time.

The final-logit processing is read from the config (`final_logit_softcapping`: Gemma 2/3;
`logit_scale`: Cohere; `logits_scaling`: Granite). A model type whose forward might do more
is not chunked by default (`CHUNKED_MODEL_TYPES` lists the ones whose loss and gradients the
tests prove equal to the full path).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dataset.encode import IGNORE_INDEX

# Model types whose causal-LM head is `lm_head` followed only by the processing below; each
# is tested against its full-logits loss (tests/test_model_families.py).
CHUNKED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")
CHUNK_BYTES = 256 * 2**20  # fp32 logits of one chunk: 256 tokens at Gemma's 262k vocabulary


def auto_chunk_tokens(model_config) -> int:
    """The default chunk: ~CHUNK_BYTES of fp32 logits, 0 (full logits) where not verified."""
    if getattr(model_config, "model_type", None) not in CHUNKED_MODEL_TYPES:
        return 0
    return max(64, CHUNK_BYTES // (4 * model_config.vocab_size))


def final_logit_processing(model_config):
    """The model's transformation of lm_head's output, as a function of fp32 logits."""
    softcap = getattr(model_config, "final_logit_softcapping", None)
    scale = getattr(model_config, "logit_scale", None)
    divide = getattr(model_config, "logits_scaling", None)

    def process(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    return process


def _piece_loss(head, process, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = process(head(hidden).float())  # [n, vocab] fp32, this chunk only
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _checkpoint(function, *args):
    """Recompute `function` in the backward. On XLA, torch_xla's checkpoint: its optimization
    barrier keeps the compiler from merging the recomputation with the forward (and keeping
    the logits after all)."""
    if args[0].device.type == "xla":
        from torch_xla.utils.checkpoint import checkpoint

        return checkpoint(function, *args, use_reentrant=True)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(function, *args, use_reentrant=False)


def chunked_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Module, model_config,
                     chunk_tokens: int) -> torch.Tensor:
    """Sum of next-token losses over label tokens. hidden: [B, L, H] the decoder's output
    (after its final norm); labels: [B, L] (-100 where not trained)."""
    batch, length, width = hidden.shape
    flat = hidden.reshape(batch * length, width)
    # Token t predicts token t + 1; the last token of each row predicts nothing.
    ignore = torch.full((batch, 1), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    targets = torch.cat([labels[:, 1:], ignore], dim=1).reshape(-1)
    piece = functools.partial(_piece_loss, head, final_logit_processing(model_config))
    tokens = batch * length
    if tokens <= chunk_tokens:
        return piece(flat, targets)
    recompute = torch.is_grad_enabled() and flat.requires_grad
    total = None
    for start in range(0, tokens, chunk_tokens):
        args = (flat[start:start + chunk_tokens], targets[start:start + chunk_tokens])
        loss = _checkpoint(piece, *args) if recompute else piece(*args)
        total = loss if total is None else total + loss
    return total


def resolve_chunk_tokens(setting: int | None, model_config) -> int:
    """train.loss_chunk_tokens resolved for this model: None -> auto_chunk_tokens; 0 -> full
    logits; N -> N, refused (ValueError naming the key) for a model type not verified."""
    if setting is None:
        return auto_chunk_tokens(model_config)
    model_type = getattr(model_config, "model_type", None)
    if setting and model_type not in CHUNKED_MODEL_TYPES:
        raise ValueError(f"train.loss_chunk_tokens={setting}: the chunked loss is verified for model types "
                         f"{list(CHUNKED_MODEL_TYPES)}, not {model_type!r}; set train.loss_chunk_tokens=0 (full logits)")
    return setting
