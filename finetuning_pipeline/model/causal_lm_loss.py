"""The causal-LM loss of a batch: next-token cross-entropy over its label tokens, per group of
rows (one per adapter side by side), with the full logits or chunked so as never to hold them.

`causal_lm_loss_sum` is the loss the training step and the evaluation take. The rest of this
file is its chunked path:

The full path builds [tokens, vocab] logits and an fp32 copy: with Gemma's 262,144-token
vocabulary, 2 x 1024 tokens are 2 GiB per fp32 copy, and the backward keeps several. Here the
decoder's last hidden states [batch, length, hidden] are cut along the length into chunks of
every row's next positions (the batch dimension whole in each chunk: under fsdp it is split
across the chips, and a chunk cut across it would be gathered onto every chip, which would then
compute the head for the global batch); each chunk goes through the output projection, the
model's own final-logit processing (soft-capping, logit scaling) and the loss in fp32, and the
backward recomputes each chunk's logits instead of storing them (torchtune's chunked-output loss
and Levanter's blockwise loss are the references).

Two things make that real on XLA, where one lazy graph holds the whole step:
- the chunks run in a `While` loop (torch_xla's scan), forward and backward: chunks written
  as a Python loop are all in one graph, and XLA:CPU then kept every chunk's logits alive at
  once (measured: the same peak as the full logits, optimization barriers or not);
- the backward is written by hand (`LinearCrossEntropy`: softmax minus one-hot through the
  processing's derivative, times the weight), so no activation of a chunk is saved.
A head that is not a plain frozen `nn.Linear` (a LoRA-wrapped or trainable lm_head) takes
checkpointed chunks instead: exact, but without the memory bound on XLA.

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
from finetuning_pipeline.model.attention_choice import kernel_masks, segment_ids, uses_kernel
from finetuning_pipeline.model.attention_masks import attention_masks
from lora_logic.modules_to_save import ModuleAdapter
from utils.device_ops import ops_for
from utils.precision import at_least_fp32

# Model types whose causal-LM head is `lm_head` followed only by the processing below; each
# is tested against its full-logits loss (tests/finetuning_pipeline/model/test_model_families.py).
CHUNKED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")
CHUNK_BYTES = 256 * 2**20  # fp32 logits of one chunk: 256 tokens at Gemma's 262k vocabulary


def auto_chunk_tokens(model_config) -> int:
    """The default chunk: ~CHUNK_BYTES of fp32 logits, 0 (full logits) where not verified."""
    if getattr(model_config, "model_type", None) not in CHUNKED_MODEL_TYPES:
        return 0
    return max(64, CHUNK_BYTES // (4 * model_config.vocab_size))


def processing_constants(model_config) -> tuple:
    """(scale, divide, softcap) of the model's final-logit processing, None where absent:
    `logit_scale` multiplies (Cohere), `logits_scaling` divides (Granite),
    `final_logit_softcapping` soft-caps (Gemma 2/3)."""
    return (getattr(model_config, "logit_scale", None), getattr(model_config, "logits_scaling", None),
            getattr(model_config, "final_logit_softcapping", None))


def process_logits(raw: torch.Tensor, scale, divide, softcap) -> torch.Tensor:
    """fp32 logits as the model's forward makes them from lm_head's output."""
    if scale is not None:
        raw = raw * scale
    if divide is not None:
        raw = raw / divide
    if softcap is not None:
        raw = torch.tanh(raw / softcap) * softcap
    return raw


def logits_gradient(logits: torch.Tensor, targets: torch.Tensor, scale, divide, softcap) -> torch.Tensor:
    """d(sum of cross-entropies)/d(lm_head output) for one chunk, fp32: (softmax - one-hot) on
    trained rows, 0 on ignored ones, through the processing's derivative."""
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    grad = torch.softmax(logits, dim=-1)
    grad = grad - torch.zeros_like(grad).scatter_(1, safe[:, None], 1.0)
    grad = grad * valid[:, None].to(grad.dtype)
    if softcap is not None:
        grad = grad * (1 - (logits / softcap) ** 2)  # d(c tanh(x / c))/dx = 1 - tanh^2
    if divide is not None:
        grad = grad / divide
    if scale is not None:
        grad = grad * scale
    return grad


@functools.lru_cache(maxsize=None)
def _bodies(scale, divide, softcap):
    """The per-chunk forward and backward, one pair of function objects per processing (so
    torch_xla's scan reuses its traces step after step)."""

    def forward(carry, xs):
        total, weight = carry
        hidden, targets = xs  # a chunk's tokens: [B, columns, H] and [B, columns] (or [tokens, H], [tokens])
        logits = process_logits(at_least_fp32(hidden.reshape(-1, hidden.shape[-1]) @ weight.t()), scale, divide,
                                softcap)
        loss = F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
        return (total + loss, weight), None

    def backward(carry, xs):
        weight, upstream = carry
        hidden, targets = xs
        logits = process_logits(at_least_fp32(hidden.reshape(-1, hidden.shape[-1]) @ weight.t()), scale, divide,
                                softcap)
        grad = logits_gradient(logits, targets.reshape(-1), scale, divide, softcap) * upstream
        return (weight, upstream), (grad.to(weight.dtype) @ weight).to(hidden.dtype).reshape(hidden.shape)

    return forward, backward


def _over_chunks(body, carry, xs):
    """Apply `body` to each chunk (the leading dimension of xs) in order: the device's loop
    (on XLA a `While` loop, so that one chunk's logits exist at a time: utils/device_ops.py)."""
    return ops_for(xs[0]).loop(body, carry, xs)


class LinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(process(hidden_i W^T), target_i) over chunks of tokens, with a hand-written
    backward that recomputes each chunk's logits: only one chunk's logits exist at a time,
    forward or backward. hidden [n_chunks, ..., H] and targets [n_chunks, ...] (chunked_loss_sum's:
    [n_chunks, B, columns, H] and [n_chunks, B, columns]); weight [V, H] frozen (no gradient)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, processing):
        forward_body, _ = _bodies(*processing)
        total = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        (total, _), _ = _over_chunks(forward_body, (total, weight), (hidden, targets))
        ctx.save_for_backward(hidden, weight, targets)
        ctx.processing = processing
        return total

    @staticmethod
    def backward(ctx, upstream):
        hidden, weight, targets = ctx.saved_tensors
        _, backward_body = _bodies(*ctx.processing)
        _, grad_hidden = _over_chunks(backward_body, (weight, at_least_fp32(upstream)), (hidden, targets))
        return grad_hidden, None, None, None


def _piece_loss(head, processing, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = process_logits(at_least_fp32(head(hidden)), *processing)  # [n, vocab] fp32, this chunk only
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _projected_loss(processing, hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    logits = process_logits(at_least_fp32(hidden @ weight.t()), *processing)
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _checkpointed_chunks(head, processing, hidden, targets, columns) -> torch.Tensor:
    """Any other head (a LoRA-wrapped or trainable lm_head): each chunk of `columns` positions
    checkpointed. Exact, but on XLA the chunks share one graph, which does not bound their memory.
    An output layer trained beside the LoRA (lora_logic/modules_to_save.py, trainable_tokens.py:
    a bias-free Linear whose weight the adapter gives) has that weight made once, the fp32 copy
    cast or the trained rows copied in, and each chunk's projection reads it: not once a chunk."""
    if isinstance(head, ModuleAdapter) and isinstance(head.original_module, torch.nn.Linear) \
            and head.original_module.bias is None:
        weight = head.weight  # (a graph input of each checkpointed chunk: its gradient reaches the adapter's)
        piece = functools.partial(_projected_loss, processing)
        recompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        checkpointed = functools.partial(ops_for(hidden).checkpoint, piece)
        losses = [(checkpointed if recompute else piece)(hidden[:, start:start + columns].flatten(0, 1),
                                                          targets[:, start:start + columns].flatten(), weight)
                  for start in range(0, hidden.shape[1], columns)]
        return torch.stack(losses).sum()
    piece = functools.partial(_piece_loss, head, processing)
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    checkpointed = functools.partial(ops_for(hidden).checkpoint, piece)  # (XLA: behind a barrier, not merged away)
    losses = [
        (checkpointed if recompute else piece)(
            hidden[:, start:start + columns].flatten(0, 1), targets[:, start:start + columns].flatten()
        )
        for start in range(0, hidden.shape[1], columns)
    ]
    return torch.stack(losses).sum()


def chunked_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Module, model_config,
                     chunk_tokens: int) -> torch.Tensor:
    """Sum of next-token losses over label tokens. hidden: [B, L, H] the decoder's output
    (after its final norm); labels: [B, L] (-100 where not trained)."""
    batch, length, width = hidden.shape
    # Token t predicts token t + 1; the last token of each row predicts nothing.
    ignore = torch.full((batch, 1), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    targets = torch.cat([labels[:, 1:], ignore], dim=1)  # [B, L]
    processing = processing_constants(model_config)
    if batch * length <= chunk_tokens:
        return _piece_loss(head, processing, hidden.flatten(0, 1), targets.flatten())
    # A chunk: the next `columns` positions of every row (chunk_tokens tokens in all, or one
    # position of each row when the batch alone is more).
    columns = max(1, chunk_tokens // batch)
    plain = type(head) is torch.nn.Linear and head.bias is None and not head.weight.requires_grad
    if not plain:
        return _checkpointed_chunks(head, processing, hidden, targets, columns)
    padding = -length % columns  # pad to whole chunks: padded positions are ignored
    if padding:
        hidden = torch.cat([hidden, hidden.new_zeros(batch, padding, width)], dim=1)
        targets = torch.cat([targets, targets.new_full((batch, padding), IGNORE_INDEX)], dim=1)
    chunks = hidden.shape[1] // columns
    # [n_chunks, B, columns, ...]: the loop runs over the first dimension, never over the batch's
    return LinearCrossEntropy.apply(hidden.reshape(batch, chunks, columns, width).transpose(0, 1), head.weight,
                                    targets.reshape(batch, chunks, columns).transpose(0, 1), processing)


def resolve_chunk_tokens(setting: int | None, model_config) -> int:
    """train.loss_chunk_tokens resolved for this model: None -> auto_chunk_tokens; 0 -> full
    logits; N -> N, refused (ValueError naming the key) for a model type not verified."""
    if setting is None:
        return auto_chunk_tokens(model_config)
    model_type = getattr(model_config, "model_type", None)
    if setting and model_type not in CHUNKED_MODEL_TYPES:
        raise ValueError(
            f"train.loss_chunk_tokens={setting}: the chunked loss is verified for model types "
            f"{list(CHUNKED_MODEL_TYPES)}, not {model_type!r}; set train.loss_chunk_tokens=0 (full logits)"
        )
    return setting


def causal_lm_loss_sum(model, batch: dict[str, torch.Tensor], packed: bool = True,
                       loss_chunk: int = 0, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token losses over label tokens, number of label tokens), fp32, on device.
    groups > 1: the rows are that many equal groups, one per adapter trained side by side
    (lora_logic/layer.py): both are [groups], each group's loss computed on its rows
    alone, as a run of that adapter alone computes it on its batch.

    packed: the block holds separate samples (phase 2): positions restart per sample and each
    sample attends to itself only. Otherwise (phase 1: one stream of text, positions 0..L-1)
    the masks are [1, 1, L, L], broadcast over the batch (cheaper than [B, 1, L, L]: 12% of a
    step on the benchmark's large model). Each layer type gets its own mask (attention_masks.py).
    loss_chunk: tokens per chunk of the output projection and loss (chunked_loss_sum, above); 0 builds
    the full logits.
    """
    input_ids = batch["input_ids"].long()
    labels = batch["labels"].long()
    position_ids = batch["position_ids"].long() if packed else None
    if uses_kernel(model.config):  # Pallas attention: segment ids instead of [L, L] masks
        masks = kernel_masks(model.config, segment_ids(position_ids, *input_ids.shape, input_ids.device))
    else:
        masks = attention_masks(model.config, input_ids.shape[1], input_ids.device, model.dtype, position_ids)
    inputs = {"input_ids": input_ids, "attention_mask": masks, "use_cache": False}
    if packed:
        inputs["position_ids"] = position_ids
    trained = labels[:, 1:] != IGNORE_INDEX
    if groups == 1:
        count = trained.sum().to(torch.float32)
    else:
        count = trained.reshape(groups, -1).sum(-1).to(torch.float32)
    rows = input_ids.shape[0] // groups

    def each_group(tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor] if groups == 1 else [tensor[k * rows:(k + 1) * rows] for k in range(groups)]

    if loss_chunk:
        hidden = model.base_model(**inputs).last_hidden_state  # [B, L, H], after the final norm
        sums = [chunked_loss_sum(h, y, model.get_output_embeddings(), model.config, loss_chunk)
                for h, y in zip(each_group(hidden), each_group(labels))]
    else:
        logits = model(**inputs).logits
        # Token t predicts token t+1: logits [B, L-1, V] against labels [B, L-1].
        sums = [F.cross_entropy(at_least_fp32(x[:, :-1]).reshape(-1, x.shape[-1]), y[:, 1:].reshape(-1),
                                ignore_index=IGNORE_INDEX, reduction="sum")
                for x, y in zip(each_group(logits), each_group(labels))]
    return (sums[0] if groups == 1 else torch.stack(sums)), count
