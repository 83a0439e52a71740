"""GGUF files for llama.cpp (and Ollama, LM Studio): the base with adapters merged, the base
alone, or the adapters alone as a LoRA GGUF that llama.cpp applies to the base's GGUF at load
(`--lora`).

Streamed tensor by tensor: the base is read from its mapped safetensors files, each tensor is
merged, reordered for llama.cpp (gguf_families.py) and encoded (gguf_tensors.py) only when its
turn to be written comes, so the host holds the mapped files and one tensor, never a second copy
of the model. Every check (the family, the outtype, the tokenizer, each adapter against the base,
the output) runs before the first byte is written; the file appears only when complete.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch
from tqdm import tqdm

from finetuning_pipeline.errors import ModelLoadError
from finetuning_pipeline.exporters.gguf_families import (
    extra_tensors,
    family_notes,
    family_of,
    family_problems,
    permute_rotary_rows,
    rotary_heads,
    to_gguf_values,
    write_metadata,
)
from finetuning_pipeline.exporters.gguf_tensors import (
    FILE_TYPES,
    OUTTYPES,
    BaseTensors,
    add_tensor_info,
    encode,
    encode_in_row_blocks,
    encoded_bytes,
    tensor_type,
)
from finetuning_pipeline.exporters.gguf_vocab import read_vocab, write_vocab
from finetuning_pipeline.model.lineage import check_stack, quantized_from, same_blocks, trained_quantized
from lora_logic.adapter_io import read_adapter_config, read_adapter_weights
from utils.output_guard import claim_output, staged_file
from utils.tokenizer_loading import load_tokenizer

COMMAND = "finetuning_pipeline.export"
WRITTEN_BY = "tpu_lora.written_by"  # the key by which an existing --out is recognised as ours
ADAPTER_OUTTYPES = ("f32", "f16", "bf16")  # llama.cpp computes a LoRA's products in these


@dataclass
class Update:
    """One adapter's update of one base weight: scaling * B A; `adapter`: its place in the stack."""

    adapter: int
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float


def export_gguf(base: str, adapters: list[str], out: str, outtype: str, tokenizer: str | None = None,
                force: bool = False, adapter_only: bool = False, warn=None) -> Path:
    """Write `out`: the base with `adapters` merged (in order), or the base alone (no adapters), or
    with adapter_only the adapters as one LoRA GGUF for the base. Returns `out`."""
    warn = warn or (lambda message: print(message, file=sys.stderr, flush=True))
    out_path, base_path = Path(out), Path(base)
    try:
        if adapter_only and not adapters:
            raise ValueError("--adapter-only writes adapters: pass at least one --adapter")
        allowed = ADAPTER_OUTTYPES if adapter_only else tuple(OUTTYPES)
        if outtype not in allowed:
            what = "a LoRA GGUF (--adapter-only)" if adapter_only else "a GGUF"
            if outtype.lower() in allowed:
                hint = f"; did you mean {outtype.lower()}?"
            elif adapter_only and outtype.lower() in OUTTYPES:
                hint = "; the base's own GGUF takes q8_0 or q4_0"
            elif outtype.lower().startswith(("q", "iq")):  # Q4_K_M, IQ4_XS, ...: llama.cpp's C++ quantizers
                kind = outtype.upper()
                hint = (f"; K-quants are llama.cpp's own: write f16, then `llama-quantize model-f16.gguf "
                        f"model-{kind}.gguf {kind}`")
            else:
                hint = ""
            raise ValueError(f"--outtype {outtype}: {what} is written as one of {', '.join(allowed)}{hint}")
        config = read_config(base_path)
        family = family_of(config)
        problems = family_problems(config)
        if problems:
            raise ValueError(f"--base {base}: llama.cpp's {gguf.MODEL_ARCH_NAMES[family.arch]} would not compute "
                             f"what this model computes: {'; '.join(problems)}")
        inputs = {"--base": base, "--tokenizer": tokenizer, **{f"--adapter {a}": a for a in adapters}}
        claim_output(out_path, force=force, command=COMMAND, inputs=inputs, ours=written_by_us)
        check_stack(base_path, adapters, warn)
        updates = read_updates(adapters)
        with BaseTensors(base_path) as tensors:
            check_updates_fit(updates, tensors, adapters)
            for adapter in adapters:
                if fmt := trained_quantized(adapter):
                    warn(quantized_note(adapter, fmt, adapter_only, tensors.float_dtypes()))
            if adapter_only:
                write = adapter_file(config, updates, outtype)
            else:
                tokenizer_dir = Path(tokenizer or base)
                vocab = read_vocab(tokenizer_dir, config.vocab_size, "--tokenizer" if tokenizer else "--base")
                hf_tokenizer = load_tokenizer(tokenizer_dir, "--tokenizer" if tokenizer else "--base")
                for note in [*family_notes(config), *vocab.notes]:
                    warn(f"note: {note}")
                write = model_file(config, tensors, updates, outtype, vocab, tokenizer_dir, hf_tokenizer, base_path)
    except (ValueError, FileNotFoundError) as err:  # what the user gave: one line, before anything is written
        raise ModelLoadError(str(err)) from None
    with BaseTensors(base_path) as tensors, staged_file(out_path) as staging:
        write(staging, tensors)
    return out_path


def quantized_note(adapter: str, fmt: str, adapter_only: bool, file_dtypes: set[str]) -> str:
    """What an adapter trained on the base stored as `fmt` (model.quantize) gets from this export:
    merged, the full-precision weights; alone, the base's GGUF in `fmt`, whose blocks are quantized
    from the files' values (`file_dtypes`): the trained ones only when the run quantized those."""
    if not adapter_only:
        return (f"adapter {adapter} was trained on the base stored as {fmt}; it is merged into the base's "
                "full-precision weights, as QLoRA adapters are: close to, not equal to, what it trained on "
                f"(for the trained blocks: the base alone as --outtype {fmt}, and the adapter with --adapter-only)")
    run_dtype, files = quantized_from(adapter), " / ".join(sorted(file_dtypes))
    same = same_blocks(run_dtype, file_dtypes)
    if same:
        return (f"note: adapter {adapter} was trained on the base stored as {fmt} (model.quantize), quantized from "
                f"the files' {files} values: serve it on the base's GGUF in --outtype {fmt}, which holds the very "
                "blocks it was trained on")
    if same is False:
        return (f"note: adapter {adapter} was trained on the base stored as {fmt} (model.quantize), quantized from "
                f"its values rounded to {run_dtype} (model.dtype); the base's GGUF in --outtype {fmt} is quantized "
                f"from the files' {files} values, so its blocks are close to, not equal to, those it was trained on")
    return (f"note: adapter {adapter} was trained on the base stored as {fmt} (model.quantize); the base's GGUF in "
            f"--outtype {fmt} holds the blocks it was trained on only if the run's model.dtype was the files' own "
            f"({files}) or float32, which its lineage.json does not say")


def read_config(base: Path):
    from transformers import AutoConfig

    if not (base / "config.json").is_file():
        raise ValueError(f"--base {base}: no config.json; pass a Hugging Face model directory")
    return AutoConfig.from_pretrained(base)


def written_by_us(path: Path) -> bool:
    """Whether `path` is a GGUF file an earlier export wrote (what --force may replace)."""
    if not path.is_file():
        return False
    try:
        field = gguf.GGUFReader(path).get_field(WRITTEN_BY)
        return field is not None and field.contents() == COMMAND
    except (ValueError, OSError, IndexError):
        return False


def read_updates(adapters: list[str]) -> dict[str, list[Update]]:
    """{base weight name: its updates, in the adapters' order}."""
    updates: dict[str, list[Update]] = {}
    for index, adapter in enumerate(adapters):
        lora_config, _ = read_adapter_config(adapter)
        for module, (lora_a, lora_b) in read_adapter_weights(adapter).items():
            updates.setdefault(f"{module}.weight", []).append(Update(index, lora_a, lora_b, lora_config.scaling))
    return updates


def merged(weight: torch.Tensor, stack: list[Update]) -> torch.Tensor:
    """W0 + scaling B A for each adapter in order, in fp32, as lora_logic's merge computes it."""
    for update in stack:
        weight = weight + (update.lora_b.float() @ update.lora_a.float()) * update.scaling
    return weight


def check_updates_fit(updates: dict[str, list[Update]], tensors: BaseTensors, adapters: list[str]) -> None:
    """Every adapter's modules are weights of this base, of their shapes: else it is another base's."""
    names = set(tensors.names())
    for name, stack in updates.items():
        module = name.removesuffix(".weight")
        if name not in names:
            raise ValueError(f"--adapter: module {module!r} is not in --base (an adapter for another base? "
                             f"adapters: {', '.join(adapters)})")
        for update in stack:
            shape = (update.lora_b.shape[0], update.lora_a.shape[1])
            if shape != tensors.shape(name)[:2]:
                raise ValueError(f"--adapter: module {module!r} is {list(shape)} in the adapter but "
                                 f"{list(tensors.shape(name))} in --base: an adapter for another base")


def gguf_name(tensor_map: gguf.TensorNameMap, hf_name: str) -> str:
    name = tensor_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"--base: tensor {hf_name!r} has no place in llama.cpp's architecture for this family")
    return name


def base_writer(config, file_type: int | None) -> gguf.GGUFWriter:
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[family_of(config).arch])
    writer.add_string(WRITTEN_BY, COMMAND)
    if file_type is not None:
        writer.add_file_type(file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    return writer


def model_file(config, tensors: BaseTensors, updates: dict[str, list[Update]], outtype: str, vocab, tokenizer_dir,
               hf_tokenizer, base: Path):
    """The writer of the merged (or plain) model: planned now from `tensors`, written when called
    with a path and the base's tensors (opened again: planning closed them)."""
    family = family_of(config)
    tensor_map = gguf.get_tensor_name_map(family.arch, config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    planned = []  # (gguf name, hf name or None, shape, type)
    for hf_name in tensors.names():
        if hf_name == "lm_head.weight" and tied:
            continue  # llama.cpp reads token_embd in output's place
        shape = tensors.shape(hf_name)
        planned.append((gguf_name(tensor_map, hf_name), hf_name, shape, tensor_type(outtype, shape)))
    extras = extra_tensors(config)
    planned += [(name, None, tuple(t.shape), gguf.GGMLQuantizationType.F32) for name, t in extras.items()]
    fallback = [name for name, _, shape, qtype in planned
                if len(shape) > 1 and outtype in ("q8_0", "q4_0") and qtype == gguf.GGMLQuantizationType.F16]

    def write(path: Path, tensors: BaseTensors) -> None:
        writer = base_writer(config, FILE_TYPES[outtype])
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(base.resolve().name)
        write_metadata(writer, config)
        write_vocab(writer, vocab, tokenizer_dir, hf_tokenizer)
        for name, _, shape, qtype in planned:
            add_tensor_info(writer, name, shape, qtype)
        if fallback:
            print(f"note: {len(fallback)} weights ({fallback[0]}, ...) have rows that are not a multiple of 32 "
                  f"values: written in f16, not {outtype}", file=sys.stderr)
        with open_writer(writer, path):
            total = sum(encoded_bytes(shape, qtype) for _, _, shape, qtype in planned)
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {path.name}", file=sys.stderr,
                      disable=None) as bar:
                for name, hf_name, shape, qtype in planned:
                    if hf_name is None:
                        encoded = encode(extras[name], qtype)
                    elif hf_name in updates or rotary_heads(config, hf_name):  # needs the whole matrix
                        values = merged(tensors.fp32(hf_name), updates.get(hf_name, []))
                        encoded = encode(to_gguf_values(family, config, hf_name, values), qtype)
                    else:  # row by row (the embedding and the output, the largest tensors, are such)
                        encoded = encode_in_row_blocks(
                            lambda start, stop, hf_name=hf_name: to_gguf_values(
                                family, config, hf_name, tensors.fp32_rows(hf_name, start, stop)),
                            shape, qtype)
                    writer.write_tensor_data(encoded)
                    bar.update(encoded_bytes(shape, qtype))

    return write


def adapter_file(config, updates: dict[str, list[Update]], outtype: str):
    """The writer of the adapters as one LoRA GGUF. One adapter is written as it is (A, B and its
    alpha, alpha / r being llama.cpp's scaling: rsLoRA's alpha / sqrt(r) carried as alpha * sqrt(r));
    stacked adapters as one of their summed ranks, each B scaled by its own adapter's scaling and
    alpha the summed rank (a module some adapters lack gets zeros in their place, so every module
    has that rank)."""
    family = family_of(config)
    tensor_map = gguf.get_tensor_name_map(family.arch, config.num_hidden_layers)
    qtype = gguf.GGMLQuantizationType[outtype.upper()]
    ranks = {}  # each adapter's rank, by its place in the stack
    for stack in updates.values():
        for update in stack:
            ranks.setdefault(update.adapter, update.lora_a.shape[0])
    stacked = len(ranks) > 1
    pairs = []
    for hf_name, stack in updates.items():
        lora_a, lora_b = stacked_pair(stack, ranks) if stacked else (stack[0].lora_a.float(), stack[0].lora_b.float())
        heads = rotary_heads(config, hf_name)
        if family.permute_rotary and heads:
            lora_b = permute_rotary_rows(lora_b, heads)  # B's rows are q's or k's; A reads the input, unchanged
        pairs.append((gguf_name(tensor_map, hf_name), lora_a, lora_b))
    first = next(iter(updates.values()))[0]
    alpha = float(sum(ranks.values())) if stacked else first.scaling * first.lora_a.shape[0]

    def write(path: Path, _tensors: BaseTensors) -> None:
        writer = base_writer(config, None)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        for name, lora_a, lora_b in pairs:
            add_tensor_info(writer, f"{name}.lora_a", tuple(lora_a.shape), qtype)
            add_tensor_info(writer, f"{name}.lora_b", tuple(lora_b.shape), qtype)
        with open_writer(writer, path):
            for _, lora_a, lora_b in pairs:
                writer.write_tensor_data(encode(lora_a, qtype))
                writer.write_tensor_data(encode(lora_b, qtype))

    return write


def stacked_pair(stack: list[Update], ranks: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked adapters' updates of one weight as one pair of the summed rank, [A1; A2; ...] and
    [s1 B1, s2 B2, ...], so that B A = s1 B1 A1 + s2 B2 A2 + ...; an adapter that lacks this
    weight adds zeros of its rank (every module then has the one rank that alpha is written for)."""
    by_adapter = {update.adapter: update for update in stack}
    width, height = stack[0].lora_a.shape[1], stack[0].lora_b.shape[0]
    a_parts, b_parts = [], []
    for adapter, rank in sorted(ranks.items()):
        update = by_adapter.get(adapter)
        if update is None:
            a_parts.append(torch.zeros(rank, width))
            b_parts.append(torch.zeros(height, rank))
        else:
            a_parts.append(update.lora_a.float())
            b_parts.append(update.lora_b.float() * update.scaling)
    return torch.cat(a_parts), torch.cat(b_parts, dim=1)


class open_writer:
    """The header, metadata and tensor table written to `path`, the file closed at the end."""

    def __init__(self, writer: gguf.GGUFWriter, path: Path):
        self.writer, self.path = writer, path

    def __enter__(self):
        self.writer.write_header_to_file(self.path)
        self.writer.write_kv_data_to_file()
        self.writer.write_ti_data_to_file()
        return self.writer

    def __exit__(self, *exc) -> None:
        self.writer.close()
