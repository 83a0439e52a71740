"""`make tpu-check`: the paths only a TPU takes, tried on a small copy of the run's model in the
first minutes on the TPU, before the long run spends the week's quota on them.

The check trains phase 1 of a 2-layer copy of the configured architecture for CHECK_STEPS
steps through main.py, on this machine's device, in the configured parallel mode, dtype,
attention, step capture and layer scan ("as configured"), then once more per setting that
takes a TPU-only path, with that one setting changed: the losses of each pair must agree.
On a TPU the copy keeps the real width (its layers are the real layers: the step time, HBM and
compile seconds measured on it are the chip's), on a CPU it is also narrowed (checks/rehearsal.py).

  attention       the kernel as configured vs model.attention=dense
  captured step   train.capture_step vs the step traced every time
  scanned layers  train.scan_layers vs the layer loop
  bf16            model.dtype=bfloat16 vs float32
  quantized base  model.quantize as configured vs the same model holding its dequantized weights
                  (equal step for step), and the step time of the two
  collectives     N replicas vs one chip with their global batch (parallel.single_chip; on a pod,
                  chip 0 of host 0 alone, while the other hosts wait)
  recompiles      no graph compiled after warm-up; no host sync in a step
  donation        every state tensor the captured step updates donates its buffer
  HBM             peak device memory vs the plan of the same small model (tpu_plan.py)
  compile         seconds to compile 2 layers and 1 (a run of a 1-layer copy): the part that
                  grows with the depth and the part that does not, which the next plan uses
  MFU             step time over TIMED_STEPS steps of a run that logs once (the runs above log
                  every step, and each log waits for its step), against the chip's peak

Each is one line: passed, failed (with the setting that avoids it), skipped (why), or measured.
On a CPU the runs take the TPU host's path where a CPU can (cpu_environment: two replicas started
by the TPU's launcher, donation on); what a CPU cannot show (kernels, HBM, MFU) is skipped,
saying so. Adapters side by side are checked together, each adapter's losses compared.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from dataset.manifest import MANIFEST_NAME, read_manifest
from dataset.prepare import PrepareOptions, prepare
from dataset.samples import DOMAIN_TEXT
from finetuning_pipeline.checks.pod_hosts import ONE_HOST, HostBarrier, PodHost
from finetuning_pipeline.checks.rehearsal import RUN_TIMEOUT_S, run_trainer, shrunken_config, small_run
from finetuning_pipeline.model.attention_choice import IMPLEMENTATION
from finetuning_pipeline.model.loading import DTYPES
from finetuning_pipeline.model.quantized_base import write_dequantized_copy
from finetuning_pipeline.planning.phase_plan import plan_inputs
from finetuning_pipeline.planning.tpu_chips import Slice, parse_tpu_type
from finetuning_pipeline.planning.tpu_plan import ModelShape, plan
from finetuning_pipeline.run.run_layout import RunLayout
from finetuning_pipeline.run_config import RunConfig
from lora_logic.config import DEFAULT_ADAPTER
from utils.atomic_io import atomic_write_json
from utils.hub_models import HubModelError, model_dir
from utils.tpu_detect import tpu_generation

CHECK_STEPS = 6
CHECK_LAYERS = 2
TIMED_STEPS = 20  # the MFU run's steps after its warm-up step
CPU_REPLICAS = 2  # on a CPU, dp runs two replicas: the v2/v3 chip's shape, their sums checked
# How far two runs that differ in one setting may drift apart, per step, relative to the loss:
# summation order only (fp32; float64, the CPU's proofs, far below), or half-precision rounding
# (kernels keep other intermediates than dense): about 2.5 epsilons of bf16 (7.8e-3) or fp16 (9.8e-4).
LOSS_TOLERANCE = {"float64": 1e-6, "float32": 1e-3, "float16": 5e-3, "bfloat16": 2e-2}
HBM_OVER_PLAN = 1.25  # measured peak above this multiple of the plan: the plan is not to be trusted
ALIAS_REPORT_ROUNDING = 2**30 * 5e-7 + 1  # torch_xla reports sizes in GB to 6 decimals (+1: ours to bytes)
# The sizes of torch_xla's post-compilation report, in its order: our name -> its label.
COMPILED_SIZES = {"inputs": "Graph input", "outputs": "Graph output", "aliased": "Aliased Input",
                  "temporaries": "Intermediate tensor", "code": "Compiled program"}


@dataclass
class Check:
    name: str
    status: str  # passed | failed | skipped | measured
    detail: str
    avoid: str | None = None  # on failure: the setting that avoids it

    def line(self) -> str:
        tail = f" -> avoid it with: {self.avoid}" if self.status == "failed" and self.avoid else ""
        return f"  {self.status:>8}  {self.name}: {self.detail}{tail}"


@dataclass
class Variant:
    """A run of the check model that differs from "as configured" in one setting."""

    check: str
    overrides: dict  # dotted key -> value
    avoid: str  # the setting that avoids the path "as configured" takes, when the two disagree
    alone: bool = False  # on a pod, a run of host 0 alone (its one chip), not one of the whole slice


def check_model_config(model_config, vocab_size: int, full_width: bool):
    """The configured architecture with CHECK_LAYERS layers (one of each attention kind); at full
    width on a TPU, narrowed as the rehearsal's on a CPU."""
    if not full_width:
        return shrunken_config(model_config, vocab_size)
    small = copy.deepcopy(model_config)
    small.num_hidden_layers = CHECK_LAYERS
    if getattr(small, "layer_types", None):
        small.layer_types = (sorted(set(model_config.layer_types)) * CHECK_LAYERS)[:CHECK_LAYERS]
    small.vocab_size = max(vocab_size, model_config.vocab_size)
    return small


def check_data(config: RunConfig, root: Path, seq_len: int, blocks: int = 64) -> tuple[Path, Path, str]:
    """(data dir, tokenizer dir, description): the run's prepared phase-1 data when it is there
    with its tokenizer, else the bundled domain text, repeated to fill at least `blocks` training
    blocks of `seq_len` (a check run's global batch: a step may not repeat blocks, PhaseData),
    under the demo's tokenizer (only token ids matter to what is checked)."""
    given = next(iter(config.data_dirs(1).values()), None) or ""  # side by side: the first adapter's
    prepared = Path(given)
    adapters = list(config.phase(1).adapters)
    shared = f"; the {len(adapters)} adapters side by side ({', '.join(adapters)}) each train on it" if adapters else ""
    try:
        tokenizer = Path(config.model.tokenizer or model_dir(config.model.path, config.model.revision))
    except HubModelError:  # a Hub id not downloaded yet: the bundled text instead
        tokenizer = None
    if (prepared / MANIFEST_NAME).is_file() and tokenizer and (tokenizer / "tokenizer_config.json").is_file():
        return prepared, tokenizer, f"the run's prepared data ({prepared}){shared}"
    from finetuning_pipeline.demo.tiny_model import write_tiny_model  # transformers: only when it is needed

    tokenizer = write_tiny_model(root / "tokenizer")
    records = DOMAIN_TEXT.read_text().splitlines()
    copies = max(1, math.ceil(blocks * seq_len * 4 / sum(len(r) for r in records)))  # ~4 characters a token
    text, data = root / "text.jsonl", root / "data"
    while True:
        text.write_text("\n".join(records * copies) + "\n")
        prepare(PrepareOptions(inputs=[str(text)], tokenizer=str(tokenizer), seq_len=seq_len, out=str(data),
                               quiet=True, force=data.exists()))
        made = read_manifest(data)["counts"]["train"]
        if made >= blocks:
            break
        copies = math.ceil(copies * blocks / made * 1.1)  # (a tokenizer of shorter tokens than guessed)
    return data, tokenizer, f"the bundled domain text at seq_len {seq_len} ({given or 'phase1.data'} is not " \
                            f"prepared){shared}"


def losses(out: Path) -> dict[str, list[float]]:
    """Each adapter's logged training losses of phase 1 (one adapter: {"default": its losses})."""
    lines = (out / "phase1" / "metrics.jsonl").read_text().splitlines()
    found = {}
    for record in map(json.loads, lines):
        if record["kind"] == "train":
            for name, each in (record.get("adapters") or {DEFAULT_ADAPTER: record}).items():
                found.setdefault(name, []).append(each["loss"])
    return found


def compare(name: str, ours: Path, theirs: Path, dtype: str, avoid: str) -> Check:
    """The two runs' losses, each adapter's side by side, agree within the dtype's tolerance."""
    a, b = losses(ours), losses(theirs)
    steps = {k: (len(a[k]), len(b.get(k, []))) for k in a.keys() | b.keys()}
    if not a or any(x != y or not x for x, y in steps.values()):
        return Check(name, "failed", f"logged steps differ: {steps}", avoid)
    gap = max(abs(x - y) / max(1.0, abs(y)) for k in a for x, y in zip(a[k], b[k]))
    tolerance = LOSS_TOLERANCE[dtype]
    each = f" of each of {len(a)} adapters side by side" if len(a) > 1 else ""
    detail = f"{max(x for x, _ in steps.values())} steps{each}, largest loss gap {gap:.2e} (tolerance {tolerance:g}, " \
             f"{dtype})"
    return Check(name, "passed" if gap <= tolerance else "failed", detail, avoid)


def variants(config: RunConfig, summary: dict, dtype: str, grad_accum: int, devices_per_chip: int = 1,
             dequantized: Path | None = None, hosts: int = 1) -> tuple[list[Variant], list[Check]]:
    """The runs to compare with "as configured", from what it took (its summary); skipped lines
    for the rest. grad_accum: the check's own; devices_per_chip: the replicas one chip runs (2 on
    v2/v3), which share the global batch in the one-chip run; dequantized: the check model with
    its decoder Linears dequantized (quantized_base.write_dequantized_copy), under model.quantize;
    hosts: the pod's (host 0's one chip runs the one-chip run alone)."""
    runs, skipped = [], []
    if summary["attention"] in IMPLEMENTATION.values():
        runs.append(Variant("attention", {"model.attention": "dense"}, "model.attention=dense"))
    else:
        skipped.append(Check("attention", "skipped", f"the run takes dense attention ({summary['attention']})"))
    if summary["step_updated_state_tensors"] is not None:
        runs.append(Variant("captured step", {"train.capture_step": False}, "train.capture_step=false"))
    else:
        skipped.append(Check("captured step", "skipped", "the step is traced every time"))
    if summary["scanned_layers"]:
        runs.append(Variant("scanned layers", {"train.scan_layers": False}, "train.scan_layers=false"))
    else:
        skipped.append(Check("scanned layers", "skipped", "the run's decoder layers are not scanned"))
    precision_runs(dtype, dequantized, runs, skipped)
    # parallel.single_chip: one chip holds every replica's rows (on a pod, host 0's chip 0 alone)
    if config.parallel.mode == "dp" and summary["world_size"] > devices_per_chip:
        rows = summary["global_batch"] // (grad_accum * devices_per_chip)
        runs.append(Variant("collectives", {"parallel.single_chip": True, "train.micro_batch": rows},
                            "parallel.mode=fsdp (one SPMD process per host: no cross-replica sums on one host)",
                            alone=hosts > 1))
    elif config.parallel.mode != "dp":
        skipped.append(Check("collectives", "skipped", "parallel.mode=fsdp: the sums are inside the SPMD graph, "
                             "compared by the checks above"))
    elif summary["world_size"] == 1:
        skipped.append(Check("collectives", "skipped", "one replica: nothing is summed across replicas"))
    else:
        skipped.append(Check("collectives", "skipped", f"one chip already ({summary['world_size']} replicas, "
                             f"{devices_per_chip} a chip): its replicas' sums are the one-chip run's"))
    return runs, skipped


def precision_runs(dtype: str, dequantized: Path | None, runs: list[Variant], skipped: list[Check]) -> None:
    """The bf16 and quantized-base pairs, on both runtimes' checks: appended to `runs`, or a
    skipped line each to `skipped`."""
    if dtype == "bfloat16":
        runs.append(Variant("bf16", {"model.dtype": "float32"}, "model.dtype=float32"))
    else:
        skipped.append(Check("bf16", "skipped", f"model.dtype={dtype}"))
    if dequantized is not None:
        runs.append(Variant("quantized base", {"model.path": str(dequantized), "model.quantize": "none"},
                            "model.quantize=none"))
    else:
        skipped.append(Check("quantized base", "skipped", "model.quantize=none"))


def quantized_step(quantized: dict, dequantized: dict) -> Check:
    """The step time on the quantized base against the same step on its dequantized weights."""
    a, b = quantized["step_time_s"], dequantized["step_time_s"]
    if not a or not b:
        return Check("quantized step", "skipped", "a step time is missing (too few steps after warm-up)")
    return Check("quantized step", "measured", f"{a} s a step, {a / b:.2f}x the step on the dequantized base ({b} s); "
                 f"decoder Linears {quantized['quantized_base']['weight_bytes'] / 2**20:.1f} MiB")


def summary_checks(summary: dict, aliasing: bool, compiled: list[dict] | None = None) -> list[Check]:
    """What the as-configured run's summary shows by itself, and (donation) the bytes each graph
    of the run aliases from its inputs to its outputs once compiled (`compiled_graphs`; None:
    not reported). torch_xla counts the donors it declares before compiling; the compiled
    executable's aliases are what saves the memory, so the step's graph must alias at least the
    bytes of the state it updates."""
    checks = []
    recompiles, syncs = summary["compiles_after_warmup"], summary["host_syncs_per_step"]
    checks.append(Check("recompiles", "passed" if recompiles == 0 and not syncs else "failed",
                        f"{recompiles} graphs compiled after warm-up, {syncs} host syncs a step",
                        "find the cause with PT_XLA_DEBUG_LEVEL=2 (train.recompile_policy=warn lets a run go on)"))
    donated, updated = summary["step_donated_buffers"], summary["step_updated_state_tensors"]
    if not aliasing:
        checks.append(Check("donation", "skipped", "parameter aliasing is off (XLA_ENABLE_PARAM_ALIASING=0, the "
                            "XLA:CPU default of runtime/xla/device.py)"))
    elif updated is None or donated is None:
        checks.append(Check("donation", "skipped", "the step is traced every time, or its graph was cached"))
    else:
        detail = f"{donated} buffers donated by the step's graph for {updated} state tensors it updates"
        ok = donated == updated
        need = summary.get("step_updated_state_bytes")
        if compiled and need:
            most = max(graph["aliased"] for graph in compiled)
            detail += (f"; compiled, it aliases {most / 2**20:.3f} MiB of its inputs to its outputs for the "
                       f"{need / 2**20:.3f} MiB it updates")
            ok = ok and most >= need - ALIAS_REPORT_ROUNDING
        else:
            detail += "; the compiled graph's aliases were not reported"
        checks.append(Check("donation", "passed" if ok else "failed", detail,
                            "XLA_ENABLE_PARAM_ALIASING=0 (the LoRA weights and moments then take a second copy)"))
    return checks


def compiled_graphs(debug_file: Path) -> list[dict[str, int]] | None:
    """The memory of each graph compiled in a run, per device, as torch_xla reports the compiled
    executable (PT_XLA_DEBUG_LEVEL=1 and PT_XLA_DEBUG_FILE: "Post Compilation Analysis", sizes
    in GB to 6 decimals): its inputs, outputs, the inputs aliased to outputs (donated), its
    temporaries and its code, in bytes. None without the file or a graph reported."""
    if not debug_file.is_file():
        return None
    sizes = "".join(rf"Post Compilation Analysis: {label} size: ([0-9.]+) GB\n" for label in COMPILED_SIZES.values())
    graphs = [{key: round(float(gb) * 2**30) for key, gb in zip(COMPILED_SIZES, found)}
              for found in re.findall(sizes, debug_file.read_text())]
    return graphs or None


def compiled_peak(graph: dict[str, int]) -> int:
    """The device memory a compiled graph needs while it runs: what it reads and writes (the
    donated inputs once), its temporaries and its code."""
    return graph["inputs"] + graph["outputs"] - graph["aliased"] + graph["temporaries"] + graph["code"]


def measured_checks(summary: dict, one_layer: dict | None, timed: dict | None, planned: dict,
                    slice_: Slice | None, compiled: list[dict] | None = None) -> tuple[list[Check], dict]:
    """HBM against the plan of the same small model on `slice_` (None: not a TPU): the device's
    peak, or where the runtime reports none (the SPMD virtual device under fsdp) the largest
    compiled graph's (`compiled_graphs`; on a CPU, XLA:CPU's, only reported); the compile
    split into the part per layer and the rest (`one_layer`: the summary of the same run at 1
    layer; None when the layers are scanned, or when it failed); MFU from the `timed` run's
    step time (None: it failed). Returns (lines, figures)."""
    checks, figures = [], {}
    checks.append(hbm_line(summary.get("device_memory_peak_bytes"), compiled, planned, slice_, figures))
    checks.append(compile_split(summary, one_layer, planned, figures))
    step_time = timed and timed["step_time_s"]
    if slice_ is None or not step_time:
        why = ("not a TPU: no peak FLOP/s to measure against" if slice_ is None
               else "the timed run failed (its output is in tpu_check.log)")
        checks.append(Check("MFU", "skipped", why))
    else:
        step_flops = planned["flops_per_token"] * timed["global_batch"] * timed["seq_len"]
        mfu = step_flops / (step_time * slice_.peak_flops_per_device * slice_.devices)
        figures["mfu"] = round(mfu, 4)
        checks.append(Check("MFU", "measured", f"{mfu:.3f} at {step_time} s a step over {TIMED_STEPS} steps logged "
                            f"once (the plan assumed {planned['inputs']['assumed_mfu']})"))
    return checks, figures


def hbm_line(peak: int | None, compiled: list[dict] | None, planned: dict, slice_: Slice | None,
             figures: dict) -> Check:
    """The HBM line; adds the measured-over-planned ratio to `figures` on a TPU."""
    source = "peak"
    if peak is None and compiled:
        # torch_xla has no memory query for the SPMD virtual device, nor for a chip under it: the
        # compiled executables' own per-device sizes stand in (the largest graph: the step's).
        peak, source = max(compiled_peak(graph) for graph in compiled), "the largest compiled graph's"
    if peak is None:
        return Check("HBM", "skipped", "the device reports no memory in use and no compiled graph was reported")
    planned_gib = planned["hbm_per_chip_gib"]
    if slice_ is None:
        return Check("HBM", "measured", f"{source} {peak / 2**20:.1f} MiB a device (XLA:CPU's buffers, not a TPU's: "
                     f"judged against the plan, {planned_gib} GiB, on a TPU only)")
    ratio = peak / (planned_gib * 2**30)
    figures["hbm_measured_over_plan"] = round(ratio, 3)
    return Check("HBM", "passed" if ratio <= HBM_OVER_PLAN else "failed",
                 f"{source} {peak / 2**30:.2f} GiB, planned {planned_gib} GiB ({ratio:.2f}x)",
                 "model.activation_checkpointing=true or a smaller train.micro_batch; the plan "
                 f"underestimates this model by {ratio:.2f}x")


def compile_split(summary: dict, one_layer: dict | None, planned: dict, figures: dict) -> Check:
    """The compile line; adds the next plan's figures to `figures`. Unscanned, a phase's compile
    is a part per decoder layer plus the rest (embedding, head, loss, optimizer, evaluation): the
    difference between CHECK_LAYERS layers and 1 is the first, and dividing the whole by the
    layers, as a 2-layer check once did, spread the rest over a 32-layer model 16 times."""
    seconds = summary["compile_seconds"]
    if summary["scanned_layers"]:
        figures["compile_s_scanned"] = seconds
        return Check("compile", "measured", f"{seconds} s, layers scanned (the plan assumed "
                     f"{planned['inputs']['compile_s_scanned']} s)")
    inputs = planned["inputs"]
    assumed = f"the plan assumed {inputs['compile_s_fixed']} s + {inputs['compile_s_per_layer']} s a layer"
    if one_layer is None:
        return Check("compile", "measured", f"{seconds} s for {CHECK_LAYERS} layers; the 1-layer run failed (its "
                     f"output is in tpu_check.log), so the part per layer is not known ({assumed})")
    per_layer = max(seconds - one_layer["compile_seconds"], 0.0) / (CHECK_LAYERS - 1)
    fixed = max(one_layer["compile_seconds"] - per_layer, 0.0)
    figures.update(compile_s_fixed=round(fixed, 3), compile_s_per_layer=round(per_layer, 3))
    return Check("compile", "measured", f"{seconds} s for {CHECK_LAYERS} layers, {one_layer['compile_seconds']} s for "
                 f"1: {fixed:.2f} s + {per_layer:.2f} s a layer ({assumed})")


@dataclass
class CheckCopy:
    """The check's data and 2-layer model, written in a host's directory (check_copy)."""

    data: Path
    data_note: str
    tokenizer: object
    model_config: object  # the copy's
    description: str
    dequantized: Path | None  # the copy holding its dequantized weights, under model.quantize


def check_global_batch(config: RunConfig, on_tpu: bool) -> int:
    """The most sequences a step of a check's run takes (at least 64): its micro-batch (the run's
    on a TPU, 1 on a CPU) x its accumulation (at most 2: rehearsal.small_run) x the devices (the
    slice's on a TPU; on a CPU the check's replicas)."""
    devices = parse_tpu_type(config.tpu.type).devices if on_tpu else int(os.environ.get("CPU_NUM_DEVICES",
                                                                                          CPU_REPLICAS))
    micro_batch = config.train.micro_batch if on_tpu else 1
    return max(64, micro_batch * min(config.train.grad_accum, 2) * devices)


def check_copy(config: RunConfig, model_config, own: Path, seq_len: int, on_tpu: bool) -> CheckCopy:
    """The data (check_data) and the 2-layer copy of the configured model in own/model (and its
    dequantized twin in own/model_dequantized under model.quantize); on a CPU narrowed, at a
    sequence length of at most 128."""
    from transformers import AutoTokenizer

    data, tokenizer_dir, data_note = check_data(config, own, seq_len if on_tpu else min(seq_len, 128),
                                                check_global_batch(config, on_tpu))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    small = check_model_config(model_config, len(tokenizer), full_width=on_tpu)
    architecture = write_check_model(small, tokenizer, own / "model", config.train.seed)
    dequantized = None
    if config.model.quantize != "none":
        dequantized = write_dequantized_copy(own / "model", config.model.quantize, DTYPES[config.model.dtype],
                                             own / "model_dequantized")
    return CheckCopy(data, data_note, tokenizer, small,
                     f"{architecture}, {CHECK_LAYERS} layers, hidden {small.hidden_size}", dequantized)


def write_check_model(model_config, tokenizer, out: Path, seed: int) -> str:
    """A check model with the tokenizer, initialised from `seed`: the same bytes every time, and
    on every host of a pod. Returns the model's class name."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return type(model).__name__


def fewer_layers(model_config, layers: int):
    """The check model's config with `layers` decoder layers (the first of its layer kinds)."""
    fewer = copy.deepcopy(model_config)
    fewer.num_hidden_layers = layers
    if getattr(fewer, "layer_types", None):
        fewer.layer_types = fewer.layer_types[:layers]
    return fewer


# What a pod's other hosts say of a run host 0 takes alone (Variant.alone), once it has ended.
ALONE_ON_A_POD = "host 0 ran it alone, on its chip 0; host 0's report has the line"
# A rehearsed pod's host 0 alone: its torchrun environment says one process, whose replicas the
# TPU's launcher starts (a TPU VM's host 0 is one process by parallel.single_chip: runtime/xla/launch.py).
ONE_PROCESS_REHEARSAL = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                         "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "1"}


def cpu_environment(mode: str, hosts: int = 1) -> dict[str, str]:
    """On a CPU the check's runs take a TPU host's path where a CPU can: buffer donation on (the
    XLA:CPU default is off), and under dp two replicas (the v2/v3 chip's shape, so that their sums
    are checked) started by the TPU's launcher (run_config_for). In the rehearsal of a pod
    (`hosts` processes under torchrun's environment, pod_hosts.py) each host is one replica.
    What the user set wins."""
    env = {"XLA_ENABLE_PARAM_ALIASING": os.environ.get("XLA_ENABLE_PARAM_ALIASING", "1")}
    if mode == "dp" and hosts == 1:
        env["CPU_NUM_DEVICES"] = os.environ.get("CPU_NUM_DEVICES", str(CPU_REPLICAS))
    return env


def run_config_for(config: RunConfig, model_path: Path, data: Path, out: Path, on_tpu: bool, overrides: dict,
                   hosts: int = 1, *, scanned: bool) -> dict:
    """The check's run: rehearsal.small_run as configured, with `overrides` ({"section.key": value}).
    scanned: whether the full-depth run scans its decoder layers (planning.layers_scanned): the
    check's copy, of fewer layers than `auto` scans from, then scans them too, as the run will."""
    run = small_run(config, model_path=model_path, output_dir=out, data={1: data}, steps=CHECK_STEPS,
                    on_cpu=not on_tpu)
    run["train"]["scan_layers"] = scanned
    run["train"]["recompile_policy"] = "warn"  # a recompile is one of the check's lines, not the end of it
    if not on_tpu:
        run["train"]["micro_batch"] = 1
        if config.parallel.mode == "dp" and hosts == 1:
            run["parallel"]["launcher"] = "tpu"  # the TPU host's launcher: a worker process, a thread a replica
    run["checkpoint"].update(every=0, keep=1)
    run["xla"]["compile_cache_dir"] = ""  # compiled here, every time: the compile seconds are what the plan takes
    for key, value in overrides.items():
        section, name = key.split(".")
        run[section][name] = value
    return run


def device_check(config: RunConfig, model_config, root: Path, *, device: str, seq_len: int, scanned: bool,
                 host: PodHost = ONE_HOST, barrier: HostBarrier | None = None) -> dict:
    """Run the checks in `root` (output_dir/tpu_check, claimed and cleared by host 0 before this
    is called on any host); returns the report tpu_check.json holds (see the module docstring).
    On a pod (pod_hosts.py) every host calls it at once: the runs go to root/runs, one run of
    the slice each, and what this host alone reads to root/host<index>; no host starts a run
    before every host has set up, or any once one host could not (the `barrier`). scanned: whether
    the full-depth run scans its decoder layers (planning.layers_scanned), which the check's
    2-layer copy then does too: the path the run takes, and its compile_s_scanned measured."""

    on_tpu = device == "TPU"
    checked_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    report = {"device": device, "tpu_type": config.tpu.type, "checked_at": checked_at, "measured": {},
              "hosts": host.hosts}
    barrier = barrier or HostBarrier(host)
    if on_tpu:
        planned = parse_tpu_type(config.tpu.type).generation.name
        here = tpu_generation()
        if here != {"v2": "v2/v3", "v3": "v2/v3"}.get(planned, planned):
            check = Check("TPU type", "failed", f"tpu.type={config.tpu.type}, but this host's chips are {here}",
                          "tpu.type set to this slice's accelerator type")
            barrier.ready("set-up", check.detail)
            return {**report, "data": None, "model": None, "checks": [asdict(check)], "ok": False}
    own, pod_runs = root / f"host{host.index}", root / "runs"
    log = own / "tpu_check.log"
    try:
        own.mkdir(parents=True)
        made = check_copy(config, model_config, own, seq_len, on_tpu)
        data, tokenizer, small, dequantized = made.data, made.tokenizer, made.model_config, made.dequantized
    except BaseException as err:
        barrier.ready("set-up", f"{type(err).__name__}: {err}")  # the other hosts stop now, not at a timeout
        raise
    others = barrier.ready("set-up")
    report.update(data=made.data_note, log=str(log), model=made.description)
    if others:
        return {**report, "checks": [asdict(Check("set-up", "failed", "; ".join(others)))], "ok": False}
    started_runs: list[str] = []

    def train(name: str, overrides: dict, env: dict | None = None, alone: bool = False) -> tuple[Path, str | None]:
        """A run of the check (of the slice, on a pod: every host takes the same runs in order).
        alone: on a pod, a run of host 0 by itself, one host's run as on a single host (the TPU's
        launcher on a CPU too), which the other hosts wait for (wait_for_host_0)."""
        hosts = 1 if alone else host.hosts
        run = run_config_for(config, own / "model", data, pod_runs / name, on_tpu, overrides, hosts=hosts,
                             scanned=scanned)
        path = own / f"{name}.yaml"
        path.write_text(yaml.safe_dump(run))
        started_runs.append(name)
        env = {**({} if on_tpu else cpu_environment(config.parallel.mode, hosts)),
               **host.run_environment(len(started_runs) - 1), **(env or {}),
               **(ONE_PROCESS_REHEARSAL if alone and not on_tpu else {})}
        proc = run_trainer(path, ["--phase", "1", "--resume", "never", "--force"], config.parallel.mode, log, device,
                           env=env)
        failure = None if proc.returncode == 0 else (proc.stdout + proc.stderr)[-1500:]
        if alone:
            barrier.ready(name, failure and f"its run {name} failed")
        return pod_runs / name, failure

    def wait_for_host_0(name: str) -> None:
        """On a pod's other hosts: the run host 0 takes alone, waited for (its number counted, so
        that the next run's port is every host's)."""
        started_runs.append(name)
        barrier.ready(name, timeout_s=RUN_TIMEOUT_S + 60)  # (host 0's line says how it went)

    # torch_xla's report of each graph it compiles (the compiled executable's aliases: donation).
    debug_file = own / "as_configured_compiles.txt"
    reference, failure = train("as_configured", {}, {"PT_XLA_DEBUG_LEVEL": "1", "PT_XLA_DEBUG_FILE": str(debug_file)})
    if failure:
        return {**report, "checks": [asdict(Check("as configured", "failed", f"the run failed: {failure}"))],
                "ok": False}
    summary = json.loads((reference / "phase1" / "summary.json").read_text())
    dtype = config.model.dtype
    grad_accum = min(config.train.grad_accum, 2)
    per_chip = parse_tpu_type(config.tpu.type).generation.devices_per_chip if on_tpu else 1
    runs, checks = variants(config, summary, dtype, grad_accum, per_chip, dequantized, host.hosts)
    for variant in runs:
        name, alone = variant.check.replace(" ", "_"), variant.alone and host.hosts > 1
        if alone and not host.writer:
            wait_for_host_0(name)
            checks.append(Check(variant.check, "skipped", ALONE_ON_A_POD))
            continue
        out, failure = train(name, variant.overrides, alone=alone)
        changed = " ".join(f"{k}={v}" for k, v in variant.overrides.items())
        if failure:
            checks.append(Check(variant.check, "failed", f"the run with {changed} failed (as configured it ran): "
                                f"{failure[-300:]}", None))
        else:
            tolerance_dtype = "bfloat16" if "bfloat16" in (dtype, variant.overrides.get("model.dtype")) else dtype
            checks.append(compare(variant.check, reference, out, tolerance_dtype, variant.avoid))
            if variant.check == "quantized base":
                checks.append(quantized_step(summary, json.loads((out / "phase1" / "summary.json").read_text())))
    environment = os.environ if on_tpu else cpu_environment(config.parallel.mode, host.hosts)
    aliasing = environment.get("XLA_ENABLE_PARAM_ALIASING", "1") != "0"
    compiled = compiled_graphs(debug_file)
    checks += summary_checks(summary, aliasing, compiled)
    # The figures the next plan takes: the compile of the same run at 1 layer (scanned layers
    # compile one layer whatever the depth: nothing to split), and a run timed without logs.
    one_layer = None
    if not summary["scanned_layers"]:
        # (written only now: at a TPU's width even one layer with its embedding and head is GBs)
        write_check_model(fewer_layers(small, 1), tokenizer, own / "model_one_layer", config.train.seed)
        out, failure = train("compile_one_layer", {"model.path": str(own / "model_one_layer")})
        one_layer = None if failure else json.loads((out / "phase1" / "summary.json").read_text())
    out, failure = train("timed", {"train.max_steps": 1 + TIMED_STEPS, "logging.every": 1 + TIMED_STEPS})
    timed = None if failure else json.loads((out / "phase1" / "summary.json").read_text())
    slice_ = parse_tpu_type(config.tpu.type)
    small_config = copy.deepcopy(config)  # the plan of the check's own run
    small_config.train.grad_accum = grad_accum
    small_config.phase(1).data = str(data)
    small_config.phase(1).max_steps = CHECK_STEPS
    if not on_tpu:
        small_config.train.micro_batch = 1
    planned = plan(ModelShape.from_config(small), slice_,
                   plan_inputs(small_config, 1, devices=slice_.devices, model_config=small))
    measured_lines, figures = measured_checks(summary, one_layer, timed, planned, slice_ if on_tpu else None,
                                              compiled)
    checks += measured_lines
    order = ["attention", "captured step", "scanned layers", "bf16", "quantized base", "quantized step", "collectives",
             "recompiles", "donation", "HBM", "compile", "MFU"]
    checks.sort(key=lambda c: order.index(c.name) if c.name in order else len(order))
    report.update(checks=[asdict(c) for c in checks], measured=figures if on_tpu else {},
                  ok=all(c.status != "failed" for c in checks))
    return report


def format_report(report: dict) -> str:
    what = f" ({report['model']}; {report['data']})" if report["model"] else ""
    lines = [f"tpu-check on {report['device']}{what}"]
    lines += [Check(**c).line() for c in report["checks"]]
    if report["measured"]:
        lines.append(f"  measured for the next plan: {report['measured']}")
    return "\n".join(lines)


def write_report(config: RunConfig, report: dict) -> Path:
    path = RunLayout(config.output_dir).tpu_check
    atomic_write_json(path, report)
    return path
