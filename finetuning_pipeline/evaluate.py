"""Evaluate a model (optionally with an adapter) on prepared data: loss, perplexity, samples.

    python -m finetuning_pipeline.evaluate --model DIR [--adapter DIR ...] --data PREPARED_DIR
        [--split eval] [--micro-batch 4] [--samples 3] [--device cpu|xla] [--dtype float32]

The loss is the trainer's (mean next-token loss over label tokens, packed segments kept
apart), so the figures compare with the eval records in metrics.jsonl. For chat data
(phase 2), `--samples N` decodes the first N prompts of the split, generates an answer
greedily and prints it beside the reference answer.

Preference pairs (`dataset.prepare --format preference`): the preference loss and TRL's metrics
(rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
logps/rejected), averaged over the pairs, as a preference phase evaluates them:
    python -m finetuning_pipeline.evaluate --model DIR [--adapter DIR ...] --data PAIRS
        (--reference-adapter DIR | --reference base) [--loss sigmoid|ipo|hinge|orpo] [--beta 0.1]
The model is the base with the --adapters (the last one evaluated, those before it merged
beneath it, as a phase's summary lists them); its reference the same with --reference-adapter in
place of the last (the adapter a `continue` phase started from), or without it (--reference
base). The reference's log-probabilities are computed first, with the reference loaded alone,
then the model's: one model in memory at a time.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from dataset.encode import IGNORE_INDEX
from dataset.loader import open_prepared
from dataset.manifest import is_packed, tokenizer_fingerprint
from dataset.shards import PREFERENCE, open_split
from finetuning_pipeline.errors import run_command
from finetuning_pipeline.model.loading import DTYPES, check_new_tokens, context_length, load_model
from finetuning_pipeline.model.new_tokens import serving_tokenizer
from finetuning_pipeline.model.preference_loss import (
    BASE_REFERENCE,
    LOSS_TYPES,
    REFERENCE_FREE,
    PreferenceObjective,
    PreferenceSettings,
)
from finetuning_pipeline.runtime import XLA_INSTALL, torch_xla_installed
from finetuning_pipeline.runtime.native.device import native_device
from finetuning_pipeline.runtime.xla.device import choose_device, device_kind, init_xla_device, on_the_host_only
from finetuning_pipeline.runtime.xla.runtime import XlaRuntime
from finetuning_pipeline.train.eval_loop import describe_eval, evaluate_loss, evaluate_pairs, split_reference_logps
from utils.cli_types import non_negative_int, positive_int
from utils.hub_models import resolve_model
from utils.tokenizer_loading import load_tokenizer


def chat_samples(model, tokenizer, data: str, split: str, n: int, max_new_tokens: int) -> list[dict]:
    """The first n (prompt, reference, generated) triples of a phase-2 split.

    In a packed block, a segment starts at position 0; its prompt is everything before its
    first label token, its reference the label tokens of its first answer.
    """
    arrays = open_split(f"{data}/{split}")
    samples = []
    for ids, labels, positions in zip(arrays["input_ids"], arrays["labels"], arrays["position_ids"]):
        starts = list(np.flatnonzero(positions == 0)) + [len(ids)]
        for a, b in zip(starts, starts[1:]):
            trained = np.flatnonzero(labels[a:b] != IGNORE_INDEX)
            if len(trained) == 0:
                continue
            first = a + trained[0]
            run_end = first
            while run_end < b and labels[run_end] != IGNORE_INDEX:
                run_end += 1
            prompt = torch.tensor(ids[a:first], dtype=torch.long)[None]
            with torch.no_grad():
                out = model.generate(prompt.to(next(model.parameters()).device), max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=tokenizer.pad_token_id)
            samples.append({
                "prompt": tokenizer.decode(ids[a:first], skip_special_tokens=False),
                "reference": tokenizer.decode(ids[first:run_end], skip_special_tokens=True),
                "generated": tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True),
            })
            if len(samples) >= n:
                return samples
    return samples


def evaluate_preference(args, model, settings: PreferenceSettings, manifest: dict, micro_batch: int, device,
                        on_device: dict) -> dict:
    """The preference loss and TRL's metrics of the model (on `device`) over the split's pairs,
    against the reference the arguments name, whose log-probabilities are computed first on a
    reference model loaded alone (then freed)."""
    pad_id = manifest["tokenizer"]["pad_id"]
    references = None
    if settings.loss not in REFERENCE_FREE:
        reference_adapters = args.adapter[:-1] + ([args.reference_adapter] if args.reference_adapter else [])
        policy_device = next(model.parameters()).device
        model.to("cpu")  # (one model on the device at a time)
        reference, _ = load_model(args.model, reference_adapters, DTYPES[args.dtype])
        references = split_reference_logps(reference.to(device), args.data, micro_batch=micro_batch, pad_id=pad_id,
                                           device=device, split=args.split, **on_device)
        del reference
        model.to(policy_device)
    result = evaluate_pairs(model, args.data, PreferenceObjective(settings, BASE_REFERENCE), micro_batch=micro_batch,
                            pad_id=pad_id, device=device, split=args.split, references=references, **on_device)
    return {**result, "loss_type": settings.loss, "beta": settings.beta,
            "reference": None if settings.loss in REFERENCE_FREE else args.reference_adapter or "base"}


def main(argv: list[str] | None = None) -> int:
    return run_command(evaluate, argv)


def evaluate(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="tpu-lora evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model directory or a Hub id")
    parser.add_argument("--adapter", action="append", default=[],
                        help="adapter directory (repeat to stack, in order: a later phase's summary lists the "
                        "merged_adapters beneath its own)")
    parser.add_argument("--data", required=True, help="a directory written by `python -m dataset.prepare`")
    parser.add_argument("--split", default="eval", choices=("eval", "train"))
    parser.add_argument("--micro-batch", type=positive_int, default=4, help="sequences per batch (default 4)")
    parser.add_argument(
        "--samples", type=non_negative_int, default=3, help="chat samples to generate (phase-2 data only)"
    )
    parser.add_argument("--max-new-tokens", type=positive_int, default=48)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "tpu", "xla"), default="auto",
                        help="where to evaluate, in training's runtime.device words: auto (a CUDA GPU where PyTorch "
                        "sees one, else the CPU; the default), cpu, cuda, tpu (TorchTPU); or xla, torch_xla's "
                        "device (PJRT_DEVICE)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="the dtype to evaluate in (default float32; bfloat16 as a TPU trains; float64 for "
                        "the CPU's exact comparisons with a model.dtype=float64 run)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    pairs = parser.add_argument_group("preference pairs", "the reference (one of the two is required, but for the "
                                      "reference-free orpo) and the loss")
    pairs.add_argument("--reference-adapter", metavar="DIR",
                       help="the reference: this adapter in place of the last --adapter (the adapter a `continue` "
                       "preference phase started from)")
    pairs.add_argument("--reference", choices=("base",),
                       help="the reference: the model without its last --adapter (the base, with the adapters before "
                       "it merged)")
    pairs.add_argument("--loss", choices=LOSS_TYPES, default="sigmoid", help="the preference loss (default sigmoid)")
    pairs.add_argument("--beta", type=float, default=0.1, help="the reward's temperature (default 0.1, TRL's)")
    args = parser.parse_args(argv)
    if args.reference_adapter and args.reference:
        parser.error("--reference-adapter and --reference base name two references: give one")
    if args.device == "xla":
        if not torch_xla_installed():
            parser.error(f"--device xla: torch_xla is not installed in this environment; {XLA_INSTALL}, or evaluate "
                         "on the host with --device cpu")
        choose_device()
        if device_kind() == "TPU" and args.dtype == "float64":
            parser.error("--dtype float64 is for the CPU's exact comparisons; a TPU does not compute in float64: "
                         "evaluate in bfloat16 or float32 there, or on the host with --device cpu")
        device = None  # (started below, once the model is loaded)
    else:
        on_the_host_only()
        device = native_device(args.device, key="--device")  # before anything loads: a missing one is one line
    args.model = resolve_model(args.model).local_dir
    model, _ = load_model(args.model, args.adapter, DTYPES[args.dtype])
    tokenizer = load_tokenizer(*serving_tokenizer(args.model, args.adapter))
    manifest = open_prepared(args.data, fingerprint=tokenizer_fingerprint(tokenizer))
    preference = manifest.get("phase") == PREFERENCE
    if preference and args.loss not in REFERENCE_FREE and not (args.reference_adapter or args.reference):
        parser.error(f"--data {args.data} holds preference pairs: name their reference, --reference-adapter DIR (the "
                     "adapter the phase started from, usually the previous phase's) or --reference base (the model "
                     "without its last --adapter)")
    if not preference and (args.reference_adapter or args.reference):
        parser.error(f"--reference-adapter / --reference: --data {args.data} holds no preference pairs (its phase is "
                     f"{manifest.get('phase')}): a reference is for pairs prepared with --format preference")
    if preference:
        try:
            settings = PreferenceSettings(args.loss, args.beta)
        except ValueError as err:
            parser.error(str(err).replace("preference.beta", "--beta"))
    if manifest["phase"] == 2 and args.samples > 0:
        check_new_tokens(args.max_new_tokens, context_length(model.config))
    # Every batch is padded to --micro-batch rows: more rows than the split holds would only be
    # padding (--micro-batch 100000 on 12 blocks grew the process to 24 GB), and add nothing to the loss.
    micro_batch = min(args.micro_batch, max(1, manifest["counts"][args.split]))
    on_device = {}  # on the host: plain copies, nothing to mark
    if args.device == "xla":
        device, xla = init_xla_device(), XlaRuntime()
        on_device = {"to_device": xla.to_device, "boundary": xla.step_boundary}
    model.to(device)
    if preference:
        result = evaluate_preference(args, model, settings, manifest, micro_batch, device, on_device)
        print(json.dumps(result, indent=2) if args.json else f"{args.split}: {describe_eval(result)}")
        return 0
    result = evaluate_loss(
        model,
        args.data,
        micro_batch=micro_batch,
        pad_id=manifest["tokenizer"]["pad_id"],
        packed=is_packed(manifest),
        device=device,
        split=args.split,
        **on_device,
    )
    if manifest["phase"] == 2 and args.samples > 0:
        result["samples"] = chat_samples(  # (on the host under XLA: a generation's every length is a graph)
            model.to("cpu") if args.device == "xla" else model, tokenizer, args.data, args.split, args.samples,
            args.max_new_tokens)
    if args.json:
        print(json.dumps(result, ensure_ascii=False, indent=2))
        return 0
    print(f"{args.split}: {describe_eval(result)}")
    for sample in result.get("samples", []):
        print(
            f"\n--- prompt ---\n{sample['prompt']}\n--- reference ---\n{sample['reference']}"
            f"\n--- generated ---\n{sample['generated']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
