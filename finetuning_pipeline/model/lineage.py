"""What an adapter was trained on, and what a merged model is made of: the base's weights (a
fingerprint) and the adapters merged into it, in order (the sha256 of each one's weights),
recorded in `lineage.json` beside the adapter's or the merged model's files.

An adapter applied to weights other than those it was trained on gives other results with no
error (the shapes fit): an adapter of an `init: merge` phase evaluated on the raw base, or a
later phase's adapter without the earlier one beneath it. `load_model` checks each adapter it
applies against what lies beneath it there: other adapters beneath it are refused, naming the
ones to pass; another base is warned about (a copy of the base saved again in another dtype has
other bytes and is still the base). Adapters without the file (PEFT's, older runs') are applied
unchecked. Weights are compared by content, not by path: a run's directory may move. An adapter
trained on a quantized base (model.quantize) records the format too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from finetuning_pipeline.errors import ModelLoadError
from lora_logic.adapter_io import WEIGHTS_NAME
from utils.atomic_io import atomic_write_json
from utils.file_digest import sha256_file

LINEAGE = "lineage.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
# Read whole below this size; above it, SAMPLES blocks at even offsets: a 7B base's fingerprint
# costs milliseconds, where reading its 15 GB would take a minute on every command.
WHOLE_BELOW, SAMPLES, SAMPLE_BYTES = 16 << 20, 256, 4096


def base_fingerprint(model_dir: str | os.PathLike) -> str:
    """sha256 over the weight files' names and sizes and their bytes (sampled in large files):
    bases whose weights differ (another fine-tune of the same architecture) differ in it."""
    digest = hashlib.sha256()
    for path in sorted(p for pattern in WEIGHT_PATTERNS for p in Path(model_dir).glob(pattern)):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            if size <= WHOLE_BELOW:
                digest.update(f.read())
                continue
            for k in range(SAMPLES):
                f.seek(k * (size - SAMPLE_BYTES) // (SAMPLES - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return "sha256:" + digest.hexdigest()


def adapter_entry(adapter_dir: str | os.PathLike) -> dict:
    """An adapter merged beneath another: where it was, and its weights' sha256."""
    return {"path": str(adapter_dir), "sha256": "sha256:" + sha256_file(Path(adapter_dir) / WEIGHTS_NAME)}


def read_lineage(directory: str | os.PathLike) -> dict | None:
    path = Path(directory) / LINEAGE
    if not path.is_file():
        return None
    try:
        lineage = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(lineage["base"]["fingerprint"], str) or not all(
                isinstance(m["sha256"], str) for m in lineage["merged_adapters"]):
            raise TypeError("a fingerprint or sha256 is not a string")
    except (ValueError, KeyError, TypeError) as err:
        raise ModelLoadError(f"{path}: unreadable ({err!r}); the file is damaged: restore it, or delete it to apply "
                             "the adapter unchecked") from None
    return lineage


def model_lineage(model_dir: str | os.PathLike, name: str | None = None, revision: str | None = None) -> dict:
    """What the model in `model_dir` is: a merged model's recorded lineage, or this base alone
    (`name`: how the user named it, a Hub id or a path; default the directory)."""
    recorded = read_lineage(model_dir)
    if recorded is not None:
        return recorded
    return {"base": {"name": name or str(model_dir), "revision": revision, "fingerprint": base_fingerprint(model_dir)},
            "merged_adapters": []}


def with_merged(lineage: dict, adapter_dir: str | os.PathLike) -> dict:
    """`lineage` with the adapter in `adapter_dir` merged on top."""
    return {**lineage, "merged_adapters": [*lineage["merged_adapters"], adapter_entry(adapter_dir)]}


def lineage_with(model_dir: str | os.PathLike, adapters: list, name: str | None = None,
                 revision: str | None = None) -> dict:
    """What lies beneath an adapter trained or applied on `model_dir` with `adapters` merged, in order."""
    lineage = model_lineage(model_dir, name, revision)
    for adapter in adapters:
        lineage = with_merged(lineage, adapter)
    return lineage


def quantized_with(lineage: dict, fmt: str, dtype: str) -> dict:
    """`lineage` of an adapter trained on the base stored in `fmt` (model.quantize; "none": as it
    is), quantized from its values in `dtype` (model.dtype: the files' values cast to it)."""
    return lineage if fmt == "none" else {**lineage, "quantize": fmt, "quantized_from": dtype}


def trained_quantized(adapter_dir: str | os.PathLike) -> str | None:
    """The format of the quantized base the adapter was trained on (model.quantize), or None."""
    lineage = read_lineage(adapter_dir)
    return lineage.get("quantize") if lineage else None


def quantized_from(adapter_dir: str | os.PathLike) -> str | None:
    """The dtype the base's values were cast to before they were quantized for the adapter's run
    (model.dtype), or None where lineage.json does not record it (runs before it did)."""
    lineage = read_lineage(adapter_dir)
    return lineage.get("quantized_from") if lineage else None


# Dtypes that hold every value of a bf16, fp16 or fp32 file exactly.
WIDE_DTYPES = ("float32", "float64")


def same_blocks(run_dtype: str | None, file_dtypes: set[str]) -> bool | None:
    """Whether quantizing the files' values (what a GGUF export of the base does) gives the blocks a
    run that cast them to `run_dtype` first quantized: True when that cast changed no value (the
    files' own dtype, or a wider one), False when it rounded them, None when unknown (the run's
    dtype unrecorded, or files of several dtypes). file_dtypes: torch's names ("bfloat16", ...)."""
    if run_dtype is None or not file_dtypes:
        return None
    if run_dtype in WIDE_DTYPES:
        return True
    return file_dtypes == {run_dtype} if len(file_dtypes) == 1 else None


def write_lineage(directory: str | os.PathLike, lineage: dict) -> None:
    atomic_write_json(Path(directory) / LINEAGE, lineage)


def check_stack(model_dir: str | os.PathLike, adapters: list, warn) -> None:
    """check_beneath for each of `adapters` applied in order on the model in `model_dir`."""
    beneath = model_lineage(model_dir) if adapters else None
    for adapter in adapters:
        if not (Path(adapter) / WEIGHTS_NAME).is_file():
            return  # not an adapter: reading it says what it lacks
        check_beneath(adapter, beneath, warn)
        beneath = with_merged(beneath, adapter)


def check_beneath(adapter_dir: str | os.PathLike, beneath: dict, warn) -> None:
    """Refuse to apply the adapter in `adapter_dir` on adapters other than those it was trained
    on; `warn` (a str) if the base's weights are not the ones it was trained on."""
    recorded = read_lineage(adapter_dir)
    if recorded is None:
        return
    trained = [m["sha256"] for m in recorded["merged_adapters"]]
    given = [m["sha256"] for m in beneath["merged_adapters"]]
    if trained != given:
        def listed(entries):
            return ", ".join(m["path"] for m in entries) or "none"

        raise ModelLoadError(
            f"adapter {adapter_dir} was trained with these adapters merged beneath it: "
            f"{listed(recorded['merged_adapters'])}; here it would be applied on {listed(beneath['merged_adapters'])} "
            "(adapters are compared by their weights). Pass each of those with --adapter before it, in order, or a "
            f"base they are merged into (`export`); the list is in {Path(adapter_dir) / LINEAGE}")
    if recorded["base"]["fingerprint"] != beneath["base"]["fingerprint"]:
        base = recorded["base"]
        revision = f" (revision {base['revision']})" if base.get("revision") else ""
        warn(f"warning: adapter {adapter_dir} was trained on {base['name']}{revision}, whose weights differ from "
             f"this base's ({beneath['base']['name']}): the results are not the trained ones unless this is the "
             "same model saved again (in another dtype, say)")
