"""A preference phase end to end: phase 3 of the curriculum on the bundled pairs
(dataset/samples/preference.jsonl), continuing phase 2's adapter, in float64 with LoRA dropout
and two micro-batches a step. One run of phases 1 and 2 is shared; each test runs phase 3 on a
copy of it, in this process (main.main).

Claims: the phase starts from its reference (the continued adapter, frozen: its first evaluation
is ln 2 with every reward 0; over a q8_0 base too); its step is one captured graph (no compile
after warm-up, no host sync); the captured step equals the step traced every time, the native
runtime equals the XLA runtime, 2 torchrun processes and fsdp over 2 chips (layers recomputed)
equal one device, and precomputed reference log-probabilities equal the reference's forward,
within float64's bound; a resumed phase is the uninterrupted one bitwise; the loss,
beta and reference settings reach the run; TRL's metrics are logged under TRL's names and the
saved adapter holds the policy only; `evaluate` on the pairs reports what the phase's last
evaluation reported, with either reference; two adapters side by side each train as alone; ORPO
trains without a reference; on the TPU's path (the launcher's two replica threads, a bf16
base, buffer donation) the phase still starts at ln 2 and steps in one graph."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from native_helpers import NATIVE, adapters_of, assert_runs_equal
from replica_helpers import torchrun
from tolerances import BF16_UNIT_ROUNDOFF, assert_equal_in_exact_arithmetic
from trainer_helpers import SEQ_LEN, LaunchedRun, metric_records, train_in_fresh_process, write_run_config

from dataset.prepare import PrepareOptions, prepare
from dataset.samples import PREFERENCE_PAIRS
from finetuning_pipeline import evaluate, main
from finetuning_pipeline.model.preference_loss import METRIC_SUMS
from finetuning_pipeline.run.checkpointing import complete_checkpoints

SECTIONS = {"train": {"max_steps": 4, "micro_batch": 2, "grad_accum": 2}, "lora": {"r": 8, "alpha": 16, "dropout": 0.1},
            "eval": {"every": 2, "max_batches": 100}, "checkpoint": {"every": 2, "keep": 3},
            "logging": {"every": 1, "progress_bar": False, "tensorboard": True}}


@pytest.fixture(scope="module")
def curriculum(tiny_model_dir, data, tmp_path_factory) -> dict:
    """Phases 1 and 2 run once (float64), the pairs prepared, and the config of all three."""
    root = tmp_path_factory.mktemp("preference")
    pairs = root / "pairs"
    prepare(PrepareOptions(inputs=[str(PREFERENCE_PAIRS)], tokenizer=str(tiny_model_dir), seq_len=SEQ_LEN,
                           out=str(pairs), eval_fraction=0.1, quiet=True))
    config = write_run_config(root / "run.yaml", tiny_model_dir, data, root / "base",
                              model={"path": str(tiny_model_dir), "dtype": "float64"},
                              phase3={"data": str(pairs), "init": "continue"}, **SECTIONS)
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    assert main.main(["--config", str(config), "--phase", "2"]) == 0
    return {"config": config, "base": root / "base", "pairs": pairs, "model": tiny_model_dir}


def copy_of_phases_1_and_2(curriculum, out: Path) -> list[str]:
    """`out` holding the shared phases 1 and 2; main.py's arguments to run phase 3 into it."""
    for phase in ("phase1", "phase2"):
        shutil.copytree(curriculum["base"] / phase, out / phase)
    return ["--phase", "3", f"output_dir={out}"]


def phase3(curriculum, out: Path, *overrides: str) -> Path:
    """Phase 3 into `out`, on a copy of the shared phases 1 and 2, in this process."""
    arguments = copy_of_phases_1_and_2(curriculum, out)
    assert main.main(["--config", str(curriculum["config"]), *arguments, *overrides]) == 0
    return out


@pytest.fixture(scope="module")
def captured(curriculum, tmp_path_factory) -> Path:
    """Phase 3 as it runs by default on XLA: the step captured once, replayed."""
    return phase3(curriculum, tmp_path_factory.mktemp("captured") / "out")


def test_the_phase_starts_from_its_reference_and_steps_in_one_graph(captured):
    first = metric_records(captured, "eval", 3)[0]
    assert first["step"] == 0 and first["pairs"] > 0
    assert abs(first["loss"] - math.log(2)) <= 1e-15  # policy = reference: sigmoid(0) for every pair
    assert all(first[name] == 0.0 for name in ("rewards/chosen", "rewards/rejected", "rewards/margins",
                                               "rewards/accuracies"))
    summary = json.loads((captured / "phase3" / "summary.json").read_text())
    assert summary["compiles_after_warmup"] == 0 and summary["host_syncs_per_step"] == 0
    assert summary["preference"]["reference"] == "the continued adapter, frozen"
    assert summary["preference"]["loss"] == "sigmoid" and summary["preference"]["beta"] == 0.1
    assert summary["eval_loss_before"] == first["loss"] and summary["perplexity_after"] is None
    train = metric_records(captured, "train", 3)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(set(METRIC_SUMS) <= set(r) and r["label_tokens"] == 4 for r in train)  # 4 pairs a step
    assert any(r["rewards/margins"] != 0.0 for r in train[1:])  # the policy moved away from its reference
    # The saved adapter is the policy alone, in PEFT's layout: the reference is not an adapter of the run.
    (tensors,) = adapters_of(captured, 3).values()
    assert len(tensors) == 2 * 7 * 2 and not any("reference" in key for key in tensors)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((captured / "phase3").glob("**/events.out.tfevents.*")).parent))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/rewards/margins", "train/rewards/accuracies", "eval/rewards/margins"} <= tags


def evaluated(curriculum, out: Path, capsys, *reference: str) -> dict:
    """`evaluate --json` of phase 3's adapter on the pairs' eval split, in float64."""
    capsys.readouterr()
    assert evaluate.main(["--model", str(curriculum["model"]), "--adapter", str(out / "phase3" / "adapter"),
                          "--data", str(curriculum["pairs"]), "--dtype", "float64", "--device", "cpu", "--json",
                          *reference]) == 0
    return json.loads(capsys.readouterr().out)


def assert_evaluates_as_the_phase_ended(result: dict, out: Path) -> None:
    last = metric_records(out, "eval", 3)[-1]
    assert result["pairs"] == last["pairs"]
    assert_equal_in_exact_arithmetic([result["loss"]] + [result[m] for m in METRIC_SUMS],
                                     [last["loss"]] + [last[m] for m in METRIC_SUMS], "evaluate against the phase")


def test_evaluate_reports_the_phases_last_evaluation_against_the_adapter_it_continued(curriculum, captured, capsys):
    result = evaluated(curriculum, captured, capsys, "--reference-adapter", str(captured / "phase2" / "adapter"))
    assert (result["loss_type"], result["beta"]) == ("sigmoid", 0.1) and result["perplexity"] is None
    assert_evaluates_as_the_phase_ended(result, captured)
    with pytest.raises(SystemExit) as exit_status:  # argparse's usage error
        evaluate.main(["--model", str(curriculum["model"]), "--data", str(curriculum["pairs"])])
    assert exit_status.value.code == 2 and "holds preference pairs: name their reference" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["traced every step", "native runtime"])
def test_the_traced_step_and_the_native_runtime_equal_the_captured_step(curriculum, captured, how, tmp_path):
    overrides = ["train.capture_step=false"] if how == "traced every step" else NATIVE
    out = phase3(curriculum, tmp_path / "out", *overrides)
    assert_runs_equal(out, captured, [3])
    for kind in ("train", "eval"):
        ours, theirs = metric_records(out, kind, 3), metric_records(captured, kind, 3)
        assert_equal_in_exact_arithmetic([r[m] for r in ours for m in METRIC_SUMS],
                                         [r[m] for r in theirs for m in METRIC_SUMS], f"{kind} metrics")


@pytest.mark.parametrize("how", ["2 processes (torchrun)", "fsdp over 2 chips, layers recomputed"])
def test_replicas_and_fsdp_equal_one_device(curriculum, captured, how, tmp_path):
    """The same global batch of 4 pairs a step: 2 torchrun processes of 1 pair a micro-batch (their
    sums through gloo), or SPMD over 2 virtual XLA:CPU chips with activation checkpointing (a
    process of its own: SPMD is process-wide)."""
    out = tmp_path / "out"
    arguments = [*copy_of_phases_1_and_2(curriculum, out), "train.micro_batch=1"]
    if how.startswith("2 processes"):
        torchrun(2, curriculum["config"], *arguments)
    else:
        done = train_in_fresh_process(curriculum["config"], *arguments, "parallel.mode=fsdp",
                                      "model.activation_checkpointing=true", env={"CPU_NUM_DEVICES": "2"})
        assert done.returncode == 0, done.stdout + done.stderr
    assert_runs_equal(out, captured, [3])
    summary = json.loads((out / "phase3" / "summary.json").read_text())
    assert summary["compiles_after_warmup"] == 0 and summary["global_batch"] == 4


def test_the_tpus_path_two_replica_threads_a_bf16_base_and_donated_buffers(curriculum, captured, tmp_path):
    """The phase as a TPU host runs it: the TPU launcher's worker process with two replica threads
    (the v2/v3 shape; 1 pair each a micro-batch: the same 4 pairs a step), a bf16 base under fp32
    LoRA weights, buffer donation on (XLA_ENABLE_PARAM_ALIASING=1, a TPU's default) and
    recompile_policy=error: no graph after warm-up, no host sync, every state tensor the step
    updates donated (the reference's frozen copy among none of them), and the first evaluation
    still ln 2 with every reward 0: the policy's and the reference's forwards are the same
    computation in bf16 too."""
    out = tmp_path / "out"
    arguments = [*copy_of_phases_1_and_2(curriculum, out), "train.micro_batch=1", "model.dtype=bfloat16",
                 "train.recompile_policy=error"]
    run = LaunchedRun(["--config", str(curriculum["config"]), *arguments], tmp_path / "run.log", devices=2,
                      env={"XLA_ENABLE_PARAM_ALIASING": "1"})
    assert run.wait(300) == [0], run.output()
    summary = json.loads((out / "phase3" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 4, summary
    assert summary["compiles_after_warmup"] == 0 and summary["host_syncs_per_step"] == 0
    assert 0 < summary["step_updated_state_tensors"] == summary["step_donated_buffers"], summary
    first = metric_records(out, "eval", 3)[0]
    assert abs(first["loss"] - math.log(2)) <= 2**-24 and first["rewards/margins"] == first["rewards/chosen"] == 0.0
    # A sequence's log-probability is a sum of token log-probabilities of one sign, each moved by
    # bf16's rounding by at most 2^-8 of itself: the sum by at most 2^-8 of itself, and each step
    # carries the steps before on in the LoRA weights (tests/tolerances.py's reasoning, worst case).
    ours, theirs = metric_records(out, "train", 3), metric_records(captured, "train", 3)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 2, 3, 4]
    for mine, exact in zip(ours, theirs):
        for name in ("logps/chosen", "logps/rejected"):
            assert abs(mine[name] - exact[name]) <= mine["step"] * BF16_UNIT_ROUNDOFF * abs(exact[name]), (name, mine)
    assert any(r["rewards/margins"] != 0.0 for r in ours)
    (tensors,) = adapters_of(out, 3).values()
    assert {t.dtype for t in tensors.values()} == {torch.float32}


def test_a_resumed_phase_is_the_uninterrupted_one_bitwise(curriculum, captured, tmp_path):
    checkpoint = complete_checkpoints(captured / "phase3" / "checkpoints")[0]
    assert checkpoint.name.endswith("00000002")
    out = phase3(curriculum, tmp_path / "out", "--resume", str(checkpoint))
    assert json.loads((out / "phase3" / "summary.json").read_text())["resumed_from_step"] == 2
    resumed = {r["step"]: r for r in metric_records(out, "train", 3)}
    uninterrupted = {r["step"]: r for r in metric_records(captured, "train", 3)}
    assert sorted(resumed) == [3, 4]
    assert all(resumed[s]["loss"] == uninterrupted[s]["loss"] and resumed[s]["rewards/margins"]
               == uninterrupted[s]["rewards/margins"] for s in resumed)
    (ours,), (theirs,) = adapters_of(out, 3).values(), adapters_of(captured, 3).values()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_loss_beta_and_reference_settings_reach_the_phase(curriculum, tmp_path, capsys):
    """reference=base on a continued adapter: the reference is phase 2's base without the adapter,
    so the phase does not start at ln 2; loss=ipo with its beta is what the summary records."""
    out = phase3(curriculum, tmp_path / "out", "phase3.preference.reference=base", "phase3.preference.loss=ipo",
                 "phase3.preference.beta=0.5", "train.max_steps=2")
    summary = json.loads((out / "phase3" / "summary.json").read_text())["preference"]
    assert (summary["reference"], summary["loss"], summary["beta"]) == ("base", "ipo", 0.5)
    first = metric_records(out, "eval", 3)[0]
    assert first["rewards/margins"] != 0.0 and abs(first["loss"] - 1.0) > 1e-3  # IPO at the reference: (0 - 1)^2
    result = evaluated(curriculum, out, capsys, "--reference", "base", "--loss", "ipo", "--beta", "0.5")
    assert_evaluates_as_the_phase_ended(result, out)


def test_precomputed_reference_log_probabilities_equal_the_reference_forward_and_a_resume_reads_them(
        curriculum, captured, tmp_path, capsys):
    """preference.precompute_reference: computed once before the first step and kept with the
    phase; the run equals the one whose step runs the reference's forward (float64's bound), and a
    resume reads the kept ones (it says so) and is the uninterrupted run bitwise."""
    precompute = "phase3.preference.precompute_reference=true"
    out = phase3(curriculum, tmp_path / "out", precompute)
    kept = out / "phase3" / "reference_logps.npy"
    assert "computed once, kept in" in capsys.readouterr().out and kept.is_file()
    assert_runs_equal(out, captured, [3])
    # A resume from step 2 in an output dir holding the kept values (as the run's own resume would).
    (tmp_path / "resumed" / "phase3").mkdir(parents=True)
    shutil.copy(kept, tmp_path / "resumed" / "phase3")
    checkpoint = complete_checkpoints(out / "phase3" / "checkpoints")[0]
    resumed = phase3(curriculum, tmp_path / "resumed", precompute, "--resume", str(checkpoint))
    assert f"read from {resumed / 'phase3' / 'reference_logps.npy'}" in capsys.readouterr().out
    (ours,), (theirs,) = adapters_of(resumed, 3).values(), adapters_of(out, 3).values()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert [r["loss"] for r in metric_records(resumed, "train", 3)] == \
           [r["loss"] for r in metric_records(out, "train", 3) if r["step"] > 2]


def test_a_quantized_base_starts_from_its_reference_too(curriculum, tmp_path, capsys):
    """model.quantize=q8_0 under the policy and its reference (the same quantized layers): the first
    evaluation is ln 2, the step one graph; the phase says what it quantized."""
    out = phase3(curriculum, tmp_path / "out", "model.quantize=q8_0", "train.max_steps=2")
    assert "phase 3: base quantized: " in capsys.readouterr().out
    first = metric_records(out, "eval", 3)[0]
    assert abs(first["loss"] - math.log(2)) <= 1e-15 and first["rewards/margins"] == 0.0
    summary = json.loads((out / "phase3" / "summary.json").read_text())
    assert summary["quantized_base"]["format"] == "q8_0" and summary["compiles_after_warmup"] == 0


SIDE_BY_SIDE = {"x": {"lr": 1e-2, "max_steps": 4}, "y": {"lr": 5e-3, "max_steps": 3}}


def test_adapters_side_by_side_each_train_as_alone(curriculum, data, tmp_path):
    """Two adapters side by side on their own pairs (two splits of the bundled pairs), their own
    lr and steps, the base as their reference (a side-by-side phase starts fresh): each one's losses,
    rewards and final weights are its run alone's, within float64's bound."""
    pairs = {"x": data["pairs"], "y": curriculum["pairs"]}
    run = dict(SECTIONS, model={"path": str(curriculum["model"]), "dtype": "float64"},
               eval={"every": 2, "max_batches": 3})
    adapters = {name: {"data": str(pairs[name]), **settings} for name, settings in SIDE_BY_SIDE.items()}
    together = write_run_config(tmp_path / "together.yaml", curriculum["model"], data, tmp_path / "together",
                                phase1={"data": "", "adapters": adapters}, phase2={"init": "fresh"}, **run)
    assert main.main(["--config", str(together), "--phase", "1"]) == 0
    summary = json.loads((tmp_path / "together" / "phase1" / "summary.json").read_text())
    for name, settings in SIDE_BY_SIDE.items():
        alone = write_run_config(tmp_path / f"{name}.yaml", curriculum["model"], data, tmp_path / name,
                                 phase1={"data": str(pairs[name]), **settings}, **run)
        assert main.main(["--config", str(alone), "--phase", "1"]) == 0
        theirs = metric_records(tmp_path / name, "train", 1)
        ours = [r["adapters"][name] for r in metric_records(tmp_path / "together", "train", 1) if name in r["adapters"]]
        assert len(ours) == len(theirs) == settings["max_steps"]
        assert_equal_in_exact_arithmetic([r[m] for r in ours for m in ("loss", *METRIC_SUMS)],
                                         [r[m] for r in theirs for m in ("loss", *METRIC_SUMS)], f"{name} steps")
        evaluated_alone = metric_records(tmp_path / name, "eval", 1)
        evaluated_together = [r["adapters"][name] for r in metric_records(tmp_path / "together", "eval", 1)]
        assert_equal_in_exact_arithmetic([r[m] for r in evaluated_together for m in ("loss", *METRIC_SUMS)],
                                         [r[m] for r in evaluated_alone for m in ("loss", *METRIC_SUMS)],
                                         f"{name} evaluations")
        (mine,), (other,) = (adapters_of(tmp_path / "together", 1)[f"adapters/{name}"],), \
            adapters_of(tmp_path / name, 1).values()
        for key in mine:
            assert_equal_in_exact_arithmetic(mine[key], other[key], f"{name} {key}")
        assert summary["adapters"][name]["preference"]["reference"] == "base"


def test_orpo_trains_without_a_reference_and_evaluate_reports_it(curriculum, tmp_path, capsys):
    """loss=orpo: no reference (none is copied, none is named to evaluate), one graph a step, and
    `evaluate --loss orpo` with the phase's evaluation batches (2 pairs: ORPO's next-token term is a
    mean over each batch's tokens, as TRL's) reports the phase's last evaluation."""
    out = phase3(curriculum, tmp_path / "out", "phase3.preference.loss=orpo", "train.max_steps=2")
    summary = json.loads((out / "phase3" / "summary.json").read_text())
    assert summary["preference"]["reference"] == "none (reference-free)" and summary["compiles_after_warmup"] == 0
    result = evaluated(curriculum, out, capsys, "--loss", "orpo", "--micro-batch", "2")
    assert result["reference"] is None and result["loss_type"] == "orpo"
    assert_evaluates_as_the_phase_ended(result, out)
