"""make tpu-check's judgement (checks/device_check.py), on scripted run summaries: which runs it
compares, what a summary shows by itself, the measured figures, and the plan that reads them.
The check itself runs end to end in tests/e2e/test_tpu_check.py."""

from __future__ import annotations

import json

import pytest
import yaml
from trainer_helpers import run_preflight

from finetuning_pipeline.checks import device_check
from finetuning_pipeline.planning.tpu_chips import parse_tpu_type
from finetuning_pipeline.run_config import load_config

SUMMARY = {"attention": "tpu_pallas_fa", "step_updated_state_tensors": 31, "step_donated_buffers": 31,
           "scanned_layers": True, "world_size": 8, "global_batch": 16, "compiles_after_warmup": 0,
           "host_syncs_per_step": 0.0, "compile_seconds": 30.0, "step_time_s": 0.5, "seq_len": 1024,
           "device_memory_peak_bytes": 3 * 2**30}


def config(tmp_path, **sections):
    run = {"output_dir": str(tmp_path / "out"), "model": {"path": "models/mistral-7b", "dtype": "bfloat16"},
           "train": {"grad_accum": 4}, "phase1": {"data": str(tmp_path / "none"), "seq_len": 1024}, **sections}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    return load_config(path, [])


def test_every_tpu_only_path_the_run_takes_is_compared_with_it_turned_off(tmp_path):
    quantized = config(tmp_path, model={"path": "models/mistral-7b", "dtype": "bfloat16", "quantize": "q8_0"})
    runs, skipped = device_check.variants(quantized, SUMMARY, "bfloat16", grad_accum=2,
                                          dequantized=tmp_path / "dequantized")
    assert {v.check: v.overrides for v in runs} == {
        "attention": {"model.attention": "dense"}, "captured step": {"train.capture_step": False},
        "scanned layers": {"train.scan_layers": False}, "bf16": {"model.dtype": "float32"},
        # the same model holding the weights its q8_0 codes and scales stand for
        "quantized base": {"model.path": str(tmp_path / "dequantized"), "model.quantize": "none"},
        # 8 replicas' micro-batches on one chip: the same global batch of 16, 2 micro-batches a step
        "collectives": {"parallel.single_chip": True, "train.micro_batch": 8}}
    assert skipped == []
    runs, _ = device_check.variants(config(tmp_path), SUMMARY, "bfloat16", grad_accum=2, devices_per_chip=2)
    assert runs[-1].overrides["train.micro_batch"] == 4  # a v3 chip: its 2 replicas share the global batch
    assert not runs[-1].alone  # one host: a run of the host, as every other
    # a pod of 2 hosts, 4 chips each, or 8 hosts of one chip: every replica's rows on chip 0 of host 0, alone
    for hosts in (2, 8):
        runs, _ = device_check.variants(config(tmp_path), SUMMARY, "bfloat16", grad_accum=2, hosts=hosts)
        assert runs[-1].check == "collectives" and runs[-1].overrides["train.micro_batch"] == 8 and runs[-1].alone
    one_chip = {**SUMMARY, "world_size": 2}  # a v3 chip's 2 replicas: its sums are the one-chip run's
    runs, skipped = device_check.variants(config(tmp_path), one_chip, "bfloat16", grad_accum=2, devices_per_chip=2)
    assert "collectives" not in {v.check for v in runs}
    assert "one chip already (2 replicas, 2 a chip)" in skipped[-1].detail
    plain = {**SUMMARY, "attention": "sdpa", "step_updated_state_tensors": None, "scanned_layers": False,
             "world_size": 1}
    runs, skipped = device_check.variants(config(tmp_path), plain, "float32", grad_accum=2)
    assert runs == [] and [c.status for c in skipped] == ["skipped"] * 6
    runs, skipped = device_check.variants(config(tmp_path, parallel={"mode": "fsdp"}), SUMMARY, "float32", 2)
    assert "collectives" not in {v.check for v in runs}
    assert "inside the SPMD graph" in next(c.detail for c in skipped if c.name == "collectives")


def test_a_loss_gap_over_the_tolerance_fails_naming_the_setting_that_avoids_it(tmp_path):
    for name, values in (("ours", [2.0, 1.9, 1.8]), ("theirs", [2.0, 1.9, 1.75]), ("close", [2.0, 1.9, 1.79])):
        metrics = tmp_path / name / "phase1" / "metrics.jsonl"
        metrics.parent.mkdir(parents=True)
        metrics.write_text("".join(json.dumps({"kind": "train", "step": i + 1, "loss": v}) + "\n"
                                   for i, v in enumerate(values)))
    failed = device_check.compare("attention", tmp_path / "ours", tmp_path / "theirs", "bfloat16",
                                  "model.attention=dense")
    assert failed.status == "failed" and "largest loss gap 2.86e-02" in failed.detail
    assert failed.line().endswith("-> avoid it with: model.attention=dense")
    assert device_check.compare("attention", tmp_path / "ours", tmp_path / "close", "bfloat16", "x").status == "passed"
    assert device_check.compare("attention", tmp_path / "ours", tmp_path / "close", "float32", "x").status == "failed"
    # every dtype a run may take has its tolerance (float16 and float64 once raised a KeyError)
    from typing import get_args

    from finetuning_pipeline.run_config.schema import Dtype

    assert set(device_check.LOSS_TOLERANCE) == set(get_args(Dtype))
    assert {dtype: device_check.compare("x", tmp_path / "ours", tmp_path / "close", dtype, "x").status
            for dtype in ("float16", "float64")} == {"float16": "failed", "float64": "failed"}


def test_side_by_side_each_adapters_losses_are_compared_not_their_mean(tmp_path):
    """Adapter b's gap is hidden in the mean of the two (a's goes the other way): it fails."""
    def write(name, a, b):
        metrics = tmp_path / name / "phase1" / "metrics.jsonl"
        metrics.parent.mkdir(parents=True)
        metrics.write_text("".join(json.dumps({"kind": "train", "step": i + 1, "loss": (x + y) / 2,
                                               "adapters": {"a": {"loss": x}, "b": {"loss": y}}}) + "\n"
                                   for i, (x, y) in enumerate(zip(a, b))))

    write("ours", [2.0, 1.9], [2.0, 1.9])
    write("theirs", [2.0, 1.95], [2.0, 1.85])
    failed = device_check.compare("bf16", tmp_path / "ours", tmp_path / "theirs", "float32", "model.dtype=float32")
    assert failed.status == "failed" and failed.detail.startswith("2 steps of each of 2 adapters side by side, "
                                                                  "largest loss gap 2.70e-02")
    write("fewer", [2.0], [2.0])
    assert "logged steps differ" in device_check.compare("bf16", tmp_path / "ours", tmp_path / "fewer", "float32",
                                                         "x").detail


def test_on_a_cpu_the_check_takes_the_tpu_hosts_path_unless_told_otherwise(tmp_path, monkeypatch):
    monkeypatch.delenv("CPU_NUM_DEVICES", raising=False)
    monkeypatch.delenv("XLA_ENABLE_PARAM_ALIASING", raising=False)
    assert device_check.cpu_environment("dp") == {"XLA_ENABLE_PARAM_ALIASING": "1", "CPU_NUM_DEVICES": "2"}
    assert device_check.cpu_environment("fsdp") == {"XLA_ENABLE_PARAM_ALIASING": "1"}  # its own device count
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    monkeypatch.setenv("XLA_ENABLE_PARAM_ALIASING", "0")
    assert device_check.cpu_environment("dp") == {"XLA_ENABLE_PARAM_ALIASING": "0", "CPU_NUM_DEVICES": "4"}
    run = device_check.run_config_for(config(tmp_path), tmp_path / "model", tmp_path / "data", tmp_path / "o",
                                      on_tpu=False, overrides={}, scanned=False)
    assert run["parallel"]["launcher"] == "tpu" and run["train"]["micro_batch"] == 1


def test_the_check_scans_its_two_layers_when_the_full_depth_run_will(tmp_path):
    """The 2-layer copy is below the depth at which `auto` scans, so left to `auto` the check would
    run the layer loop while a 32-layer run scans, and never run torch_xla's scan on a TPU nor
    measure compile_s_scanned. The copy takes the full run's decision; the pair turns it off."""
    from transformers import AutoConfig

    from finetuning_pipeline.planning.phase_plan import layers_scanned

    depth = {layers: AutoConfig.for_model("mistral", vocab_size=64, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
             for layers in (32, 2)}
    decisions = {layers: layers_scanned(config(tmp_path), model_config) for layers, model_config in depth.items()}
    assert decisions == {32: True, 2: False}
    for layers, scanned in decisions.items():
        run = device_check.run_config_for(config(tmp_path), tmp_path / "model", tmp_path / "data", tmp_path / "o",
                                          on_tpu=True, overrides={}, scanned=scanned)
        assert run["train"]["scan_layers"] is scanned, layers
    variants, _ = device_check.variants(config(tmp_path), SUMMARY, "float32", 2)
    off = next(v for v in variants if v.check == "scanned layers")
    assert off.overrides == {"train.scan_layers": False}
    run = device_check.run_config_for(config(tmp_path), tmp_path / "model", tmp_path / "data", tmp_path / "o",
                                      on_tpu=True, overrides=off.overrides, scanned=True)
    assert run["train"]["scan_layers"] is False  # the pair's run: the layer loop


def test_recompiles_and_a_donation_short_of_the_updated_state_fail(tmp_path):
    checks = {c.name: c for c in device_check.summary_checks(SUMMARY, aliasing=True)}
    assert checks["recompiles"].status == "passed" and checks["donation"].status == "passed"
    bad = {**SUMMARY, "compiles_after_warmup": 2, "step_donated_buffers": 28}
    checks = {c.name: c for c in device_check.summary_checks(bad, aliasing=True)}
    assert checks["recompiles"].status == "failed" and "PT_XLA_DEBUG_LEVEL=2" in checks["recompiles"].avoid
    assert checks["donation"].status == "failed" and "28 buffers donated" in checks["donation"].detail
    assert checks["donation"].avoid.startswith("XLA_ENABLE_PARAM_ALIASING=0")
    assert {c.name: c.status for c in device_check.summary_checks(bad, aliasing=False)}["donation"] == "skipped"


def compile_report(*graphs: tuple[str, ...]) -> str:
    """torch_xla's post-compilation report of each graph: (inputs, outputs, aliased, temporaries, code) in GB."""
    labels = ["Graph input", "Graph output", "Aliased Input", "Intermediate tensor", "Compiled program"]
    return "".join("Post Compilation Analysis: ====\n" + "".join(
        f"Post Compilation Analysis: {label} size: {gb} GB\n" for label, gb in zip(labels, graph)) for graph in graphs)


def test_donation_is_proven_by_the_bytes_the_compiled_step_aliases(tmp_path):
    """torch_xla's donor count is declared before compiling; the compiled executable's aliases
    (its post-compilation report) must cover the bytes of the state the step updates."""
    report = tmp_path / "compiles.txt"
    report.write_text(compile_report(("0.000000",) * 5, ("0.002000", "0.000977", "0.000977", "0.000100", "0.000000")))
    compiled = device_check.compiled_graphs(report)
    assert [g["aliased"] for g in compiled] == [0, round(0.000977 * 2**30)]
    assert device_check.compiled_peak(compiled[1]) == sum(round(gb * 2**30) for gb in (0.002, 0.000977, -0.000977,
                                                                                        0.0001, 0))
    state = {**SUMMARY, "step_updated_state_bytes": 2**20}  # 1 MiB updated, 0.000977 GB (1 MiB, rounded) aliased
    line = {c.name: c for c in device_check.summary_checks(state, True, compiled)}["donation"]
    assert line.status == "passed" and "aliases 1.000 MiB of its inputs to its outputs for the 1.000 MiB" in line.detail
    short = {c.name: c for c in device_check.summary_checks({**state, "step_updated_state_bytes": 2**21}, True,
                                                            compiled)}["donation"]
    assert short.status == "failed" and short.avoid.startswith("XLA_ENABLE_PARAM_ALIASING=0")
    assert device_check.compiled_graphs(tmp_path / "none.txt") is None
    unreported = {c.name: c for c in device_check.summary_checks(state, True, None)}["donation"]
    assert unreported.status == "passed" and "aliases were not reported" in unreported.detail


def test_without_a_device_memory_query_hbm_is_the_largest_compiled_graphs():
    """Under fsdp the runtime has no memory query for the SPMD virtual device: the compiled
    graphs' per-device sizes stand in, judged on a TPU and only reported on a CPU."""
    planned = {"hbm_per_chip_gib": 1.0, "inputs": {"compile_s_scanned": 2.8, "assumed_mfu": 0.4}}
    graphs = [{"inputs": 2**29, "outputs": 2**28, "aliased": 2**28, "temporaries": 2**30, "code": 0},
              {"inputs": 2**20, "outputs": 0, "aliased": 0, "temporaries": 0, "code": 0}]
    fsdp = {**SUMMARY, "device_memory_peak_bytes": None}
    checks, figures = device_check.measured_checks(fsdp, None, None, planned, parse_tpu_type("v5e-8"), graphs)
    assert checks[0].status == "failed" and figures["hbm_measured_over_plan"] == 1.5
    assert "the largest compiled graph's 1.50 GiB, planned 1.0 GiB" in checks[0].detail
    checks, figures = device_check.measured_checks(fsdp, None, None, planned, None, graphs)
    assert checks[0].status == "measured" and "XLA:CPU's buffers" in checks[0].detail and "HBM" not in str(figures)
    assert device_check.measured_checks(fsdp, None, None, planned, None, None)[0][0].status == "skipped"


def test_hbm_over_the_plan_fails_and_mfu_and_compile_seconds_are_measured():
    v5e = parse_tpu_type("v5e-8")
    planned = {"hbm_per_chip_gib": 2.0, "flops_per_token": 1e9, "compile_s": 12.0,
               "inputs": {"compile_s_scanned": 2.8, "compile_s_fixed": 0.0, "compile_s_per_layer": 0.41,
                          "assumed_mfu": 0.4}}
    timed = {**SUMMARY, "step_time_s": 0.25}  # the run that logs once: its step time, not the logged run's
    checks, figures = device_check.measured_checks(SUMMARY, None, timed, planned, v5e)
    lines = {c.name: c for c in checks}
    assert lines["HBM"].status == "failed" and "(1.50x)" in lines["HBM"].detail  # 3 GiB against 2 planned
    assert "model.activation_checkpointing=true" in lines["HBM"].avoid
    mfu = 1e9 * 16 * 1024 / (0.25 * v5e.peak_flops_per_device * 8)
    assert figures == {"hbm_measured_over_plan": 1.5, "compile_s_scanned": 30.0, "mfu": round(mfu, 4)}
    assert lines["MFU"].status == lines["compile"].status == "measured"
    assert f"over {device_check.TIMED_STEPS} steps logged once" in lines["MFU"].detail
    assert device_check.measured_checks(SUMMARY, None, None, planned, v5e)[0][-1].status == "skipped"


def test_the_compile_is_split_into_the_part_per_layer_and_the_rest():
    """2 layers compiled in 30 s and 1 in 26 s: 4 s a layer and 22 s for the rest (30 / 2 = 15 s
    a layer would plan 480 s for 32 layers instead of 150 s)."""
    planned = {"hbm_per_chip_gib": 2.0, "inputs": {"compile_s_fixed": 0.0, "compile_s_per_layer": 0.41}}
    unscanned = {**SUMMARY, "device_memory_peak_bytes": None, "scanned_layers": False}
    checks, figures = device_check.measured_checks(unscanned, {**unscanned, "compile_seconds": 26.0}, unscanned,
                                                   planned, None)
    assert figures == {"compile_s_fixed": 22.0, "compile_s_per_layer": 4.0}
    assert {c.name: c.status for c in checks} == {"HBM": "skipped", "compile": "measured", "MFU": "skipped"}
    assert "30.0 s for 2 layers, 26.0 s for 1: 22.00 s + 4.00 s a layer" in checks[1].detail
    # A 1-layer compile no faster than 2 (noise on a small model): no part per layer, not a negative one.
    _, figures = device_check.measured_checks(unscanned, {**unscanned, "compile_seconds": 31.0}, None, planned, None)
    assert figures == {"compile_s_fixed": 31.0, "compile_s_per_layer": 0.0}
    checks, figures = device_check.measured_checks(unscanned, None, None, planned, None)
    assert figures == {} and "the 1-layer run failed" in checks[1].detail


def test_preflight_plans_with_the_chips_measured_figures_of_its_generation(tmp_path, capsys):
    """A tpu_check.json measured on a v5e: the next v5e plan takes its MFU and compile seconds;
    a v6e plan, or figures from a CPU, keep the config's."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), "model": {"path": "models/Mistral-7B-v0.3"},
                                    "phase1": {"data": str(tmp_path / "none"), "seq_len": 2048}}))
    code, assumed = run_preflight(tmp_path, path, "tpu.type=v5e-8")
    report = {"device": "TPU", "tpu_type": "v5litepod-8", "checked_at": "2026-11-24T00:00:00+00:00", "checks": [],
              "measured": {"mfu": 0.2, "compile_s_per_layer": 1.5, "compile_s_fixed": 20.0}}
    (tmp_path / "out" / "tpu_check.json").write_text(json.dumps(report))
    code, measured = run_preflight(tmp_path, path, "tpu.type=v5e-8")
    phase, before = measured["phases"]["phase1"], assumed["phases"]["phase1"]
    assert before["inputs"]["assumed_mfu"] == 0.4 and phase["inputs"]["assumed_mfu"] == 0.2
    assert phase["step_time_s"] == pytest.approx(2 * before["step_time_s"], rel=1e-2)
    assert phase["inputs"]["compile_s_per_layer"] == 1.5 and measured["chip_figures"]["mfu"] == 0.2
    looped = run_preflight(tmp_path, path, "tpu.type=v5e-8", "train.scan_layers=false")[1]["phases"]["phase1"]
    assert looped["compile_s"] == pytest.approx(20 + 1.5 * 32, abs=0.1)  # the rest once, the layers 32 times
    assert "chip figures: measured by make tpu-check" in capsys.readouterr().out
    code, other = run_preflight(tmp_path, path, "tpu.type=v6e-8")
    assert other["phases"]["phase1"]["inputs"]["assumed_mfu"] == 0.4 and other["chip_figures"] is None
    (tmp_path / "out" / "tpu_check.json").write_text(json.dumps({**report, "device": "CPU"}))
    assert run_preflight(tmp_path, path, "tpu.type=v5e-8")[1]["chip_figures"] is None


def test_without_prepared_data_the_check_fills_its_batches_from_the_bundled_text(tmp_path):
    """phase1.data not prepared and the model not downloaded (a Hub id): the bundled domain text,
    repeated, prepared at the run's sequence length into at least the blocks of a check run's
    global batch (a step may not repeat blocks): on a v5e-8, micro-batch 8 x accumulation 2 (the
    check's at most) x 8 chips; on a CPU, 64 (micro-batch 1 there)."""
    from dataset.manifest import read_manifest

    run = config(tmp_path, model={"path": "mistralai/Mistral-7B-v0.3"}, train={"micro_batch": 8, "grad_accum": 4},
                 tpu={"type": "v5e-8"})
    assert device_check.check_global_batch(run, on_tpu=True) == 128
    assert device_check.check_global_batch(run, on_tpu=False) == 64
    data, tokenizer, note = device_check.check_data(run, tmp_path / "check", seq_len=512, blocks=128)
    manifest = read_manifest(data)
    assert manifest["seq_len"] == 512 and manifest["counts"]["train"] >= 128
    assert (tokenizer / "tokenizer_config.json").is_file() and "bundled domain text at seq_len 512" in note


def test_a_tpu_type_that_is_not_this_hosts_and_a_configured_run_that_fails_are_failed_lines(
        tmp_path, tiny_model_dir, data, monkeypatch):
    """Before any run: tpu.type=v5e-8 on a host whose PCI bus shows v6e chips. Then the as-configured
    run failing (main.py's exit and output replaced): one failed line carrying its error."""
    import subprocess

    from trainer_helpers import write_run_config

    from finetuning_pipeline.planning.phase_plan import load_architecture

    run = load_config(write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out"), [])
    model_config, _ = load_architecture(str(tiny_model_dir))
    monkeypatch.setattr(device_check, "tpu_generation", lambda: "v6e")
    report = device_check.device_check(run, model_config, tmp_path / "runs", device="TPU", seq_len=64, scanned=False)
    assert [(c["name"], c["status"]) for c in report["checks"]] == [("TPU type", "failed")]
    assert "tpu.type=v5e-8, but this host's chips are v6e" in device_check.format_report(report)
    assert not (tmp_path / "runs").exists() and report["ok"] is False

    failed = subprocess.CompletedProcess([], 3, stdout="", stderr="error: phase 1 step 2: buffer deleted")
    monkeypatch.setattr(device_check, "run_trainer", lambda *args, **kwargs: failed)
    report = device_check.device_check(run, model_config, tmp_path / "runs", device="CPU", seq_len=64, scanned=False)
    (line,) = report["checks"]
    assert line["status"] == "failed" and line["detail"].endswith("error: phase 1 step 2: buffer deleted")


def test_the_check_models_are_the_same_bytes_every_time(tiny_model_dir, tmp_path):
    """Seeded, so that a pod's hosts (and a second check) write the same model."""
    from transformers import AutoConfig, AutoTokenizer

    small = device_check.check_model_config(AutoConfig.from_pretrained(tiny_model_dir), 1000, full_width=False)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    files = {}
    for copy in ("a", "b"):
        name = device_check.write_check_model(small, tokenizer, tmp_path / copy / "model", seed=3)
        device_check.write_check_model(device_check.fewer_layers(small, 1), tokenizer, tmp_path / copy / "one", seed=3)
        files[copy] = {p.relative_to(tmp_path / copy): p.read_bytes() for p in sorted((tmp_path / copy).rglob("*"))
                       if p.suffix == ".safetensors"}
    assert name == "MistralForCausalLM" and len(files["a"]) == 2 and files["a"] == files["b"]
    layers = AutoConfig.from_pretrained(tmp_path / "a" / "one").num_hidden_layers
    assert layers == 1
