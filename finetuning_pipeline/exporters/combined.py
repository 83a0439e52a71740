"""Several adapters combined into one (lora_logic/combine.py, PEFT's add_weighted_adapter), then
written as one PEFT adapter (`export --adapter-only`) or merged into the base like any adapter."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from finetuning_pipeline.errors import ModelLoadError
from finetuning_pipeline.exporters.gguf_export import export_gguf
from finetuning_pipeline.exporters.merged import COMMAND, export_merged
from finetuning_pipeline.model.lineage import read_lineage, write_lineage
from lora_logic.adapter_io import read_adapter_config, read_adapter_weights, write_adapter
from lora_logic.combine import Adapter, combine_adapters
from utils.output_guard import OutputConflict, claim_output, mark_written_by, refuse_overlap, staged_directory


def read_adapters(directories: list[str]) -> tuple[list[Adapter], str, str | None, dict | None]:
    """The adapters, the base (name or path, revision) they were all trained on, and what lay
    beneath them in training (lineage.py; None if none records it). Adapters trained on different
    weights are refused, naming both. Two adapters that record their lineage are compared by it,
    by weights and not by path (one base at two paths is one base: a run's directory may move);
    one that does not (PEFT's, an older run's) by the base named in its adapter_config.json."""
    adapters, bases = [], {}
    for directory in directories:
        config, raw = read_adapter_config(directory)
        adapters.append(Adapter(directory, config, read_adapter_weights(directory)))
        bases[directory] = (raw.get("base_model_name_or_path"), raw.get("revision"))
    recorded = {directory: lineage for directory in directories if (lineage := read_lineage(directory))}
    if recorded:  # one base by weights, named by any of its adapters
        known, lineage = next(iter(recorded.items()))
        for directory, other in recorded.items():
            if weights_beneath(other) != weights_beneath(lineage):
                raise ValueError(f"--adapter {directory} was trained on {described(other)}, --adapter {known} on "
                                 f"{described(lineage)}: adapters trained on different weights do not combine")
    unrecorded = [directory for directory in directories if directory not in recorded]
    if unrecorded:  # one base by name, which the recorded ones' names include
        first = unrecorded[0]
        for directory in unrecorded[1:]:
            if named(bases[directory]) != named(bases[first]):
                raise different_bases(directory, bases[directory], first, bases[first])
        if recorded and not any(named(bases[d]) == named(bases[first]) for d in recorded):
            other = next(iter(recorded))
            raise different_bases(first, bases[first], other, bases[other])
    return adapters, *bases[directories[0]], next(iter(recorded.values()), None)


def named(base: tuple[str | None, str | None]) -> tuple[str | None, str | None]:
    """A base (name, revision) as comparable: a local directory by its real path (one base written
    as a relative and as an absolute path, or through a link, is one base), a Hub id as it is."""
    name, revision = base
    return (os.path.realpath(name) if name and Path(name).is_dir() else name), revision


def different_bases(directory: str, base: tuple, other: str, other_base: tuple) -> ValueError:
    return ValueError(f"--adapter {directory} was trained on {base[0]} (revision {base[1]}), --adapter {other} on "
                      f"{other_base[0]} (revision {other_base[1]}): adapters of different bases do not combine (an "
                      "adapter whose lineage.json is missing is known by the base named in its adapter_config.json)")


def weights_beneath(lineage: dict) -> tuple:
    return lineage["base"]["fingerprint"], tuple(m["sha256"] for m in lineage["merged_adapters"])


def described(lineage: dict) -> str:
    merged = ", ".join(m["path"] for m in lineage["merged_adapters"])
    return f"{lineage['base']['name']}" + (f" with {merged} merged beneath" if merged else "")


def export_combined(base: str, directories: list[str], out: str, *, weights: list[float], method: str,
                    density: float | None = None, svd_rank: int | None = None, seed: int = 0,
                    adapter_only: bool = False, dtype: str = "auto", tokenizer: str | None = None,
                    force: bool = False, gguf: dict | None = None) -> Path:
    """Combine the adapters in `directories` and write the result to `out`: one PEFT adapter
    (adapter_only), else the base with it merged (merged_export.export_merged). Returns `out`.
    gguf ({"outtype": ...}): a GGUF file instead, of the combined adapter or the merged model."""
    # The adapters reach the writers below as one temporary adapter: --out is checked against them here.
    refuse_overlap(out, {f"--adapter {d}": d for d in directories})
    try:  # what the user gave that does not fit: one line, exit 2 (errors.py)
        adapters, trained_on, revision, lineage = read_adapters(directories)
        config, modules = combine_adapters(adapters, weights, method, density=density, svd_rank=svd_rank,
                                           generator=torch.Generator().manual_seed(seed))
    except (ValueError, FileNotFoundError) as err:
        raise ModelLoadError(str(err)) from None
    tensors = {}
    for module, (lora_a, lora_b) in modules.items():
        tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"] = lora_a, lora_b
    if adapter_only and gguf is None:
        out_path = Path(out)
        claim_output(out_path, force=force, command=COMMAND, inputs={f"--adapter {d}": d for d in directories})
        with staged_directory(out_path) as staging:
            write_combined(staging, tensors, config, trained_on or base, revision, lineage)
            mark_written_by(staging, COMMAND)
        return out_path
    with combined_adapter(directories) as (combined, warn):
        write_combined(combined, tensors, config, trained_on or base, revision, lineage)
        if gguf is not None:
            return export_gguf(base, [combined], out, gguf["outtype"], tokenizer, force, adapter_only=adapter_only,
                               warn=warn)
        return export_merged(base, [combined], out, dtype, tokenizer, force, warn=warn)


@contextlib.contextmanager
def combined_adapter(directories: list[str]) -> Iterator[tuple[str, Callable[[str], None]]]:
    """A temporary directory for the combined adapter, which the writers take by path like any
    adapter, and the `warn` to hand them: their notes, and the errors they raise, name it as the
    user knows it (the --adapter directories combined), not as a temporary path."""
    shown = " + ".join(map(str, directories)) + " (combined)"
    with tempfile.TemporaryDirectory(prefix="combined-adapter-") as combined:
        def warn(message: str) -> None:
            print(message.replace(combined, shown), file=sys.stderr, flush=True)

        try:
            yield combined, warn
        except (ModelLoadError, OutputConflict) as err:
            raise type(err)(str(err).replace(combined, shown)) from None


def write_combined(directory, tensors: dict, config, base: str, revision: str | None, lineage: dict | None) -> None:
    """The combined adapter, trained (through its parts) on what they were trained on."""
    write_adapter(directory, tensors, config, base, revision)
    if lineage is not None:
        write_lineage(directory, lineage)
