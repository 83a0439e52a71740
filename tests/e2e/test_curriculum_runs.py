"""A curriculum longer than two phases, end to end on XLA:CPU: each phase starts from what its
`init` down the chain says (the previous adapter continued, merged beneath a fresh one, or the
untouched base), the summary names the adapters a phase is served with, a later phase resumes
bitwise from its checkpoint, and a phase run alone finds the earlier adapters on disk."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file
from tolerances import assert_equal_in_exact_arithmetic, fp32_forward_bound
from trainer_helpers import LaunchedRun, write_run_config
from transformers import AutoConfig

from finetuning_pipeline import main
from finetuning_pipeline.evaluate import main as evaluate_main
from finetuning_pipeline.exporters.merged import export_merged

INITS = {2: "continue", 3: "merge", 4: "continue", 5: "fresh"}


@pytest.fixture(scope="module")
def curriculum(tiny_model_dir, data, tmp_path_factory):
    """Five phases on one dataset (so one phase's final eval is the next one's first, wherever
    the next one starts from where this one ended), 4 steps each; then two adapters side by side
    on phase 5's adapter merged."""
    root = tmp_path_factory.mktemp("curriculum")
    phases = {f"phase{n}": {"data": str(data[1]), "init": init} for n, init in INITS.items()}
    side_by_side = {"adapters": {"text": {"data": str(data[1])}, "chat": {"data": str(data[2])}}, "init": "merge"}
    config = write_run_config(root / "run.yaml", tiny_model_dir, data, root / "out", train={"max_steps": 4},
                              eval={"every": 0, "max_batches": None}, checkpoint={"every": 2, "keep": 2},
                              phase1={"data": str(data[1])}, **phases, phase6=side_by_side)
    assert main.main(["--config", str(config)]) == 0
    return root / "out", config


def summary(out, phase: int) -> dict:
    return json.loads((out / f"phase{phase}" / "summary.json").read_text())


def assert_same_fp32_loss(ours: float, theirs: float, what: str, model_dir, merged: bool = False) -> None:
    """Two fp32 evaluations of one model (the run's default dtype) in other sums, or of its merge:
    within fp32_forward_bound (tests/tolerances.py)."""
    bound = fp32_forward_bound(theirs, AutoConfig.from_pretrained(model_dir), merged=merged)
    assert_equal_in_exact_arithmetic(ours, theirs, what, bound)


def test_each_phase_starts_from_what_its_init_says(curriculum, tiny_model_dir):
    out, _ = curriculum
    s = {n: summary(out, n) for n in range(1, 6)}
    assert all(s[n]["steps"] == 4 and s[n]["compiles_after_warmup"] == 0 for n in s)
    # continue (2, 4) and merge (3) start from the model the phase before ended with ...
    for n in (2, 3, 4):
        if INITS[n] == "continue":  # the same weights and graph: the same loss, bit for bit
            assert s[n]["eval_loss_before"] == s[n - 1]["eval_loss_after"], n
        else:  # merged: each W0 + s B A rounded once to fp32
            assert_same_fp32_loss(s[n]["eval_loss_before"], s[n - 1]["eval_loss_after"], f"phase {n}'s start",
                                  tiny_model_dir, merged=True)
    # ... and they train on from there; fresh (5) starts again from the untouched base.
    assert s[4]["eval_loss_after"] < s[2]["eval_loss_after"] < s[1]["eval_loss_before"]
    assert s[5]["eval_loss_before"] == s[1]["eval_loss_before"]  # B = 0: the base's own loss, bit for bit
    assert [s[n]["merged_adapters"] for n in range(1, 6)] == [[], [], [str(out / "phase2" / "adapter")],
                                                               [str(out / "phase2" / "adapter")], []]
    assert (out / "loss.png").stat().st_size > 10_000


def test_a_later_phase_is_served_with_the_adapters_its_summary_names(curriculum, tiny_model_dir, data, tmp_path,
                                                                    capsys):
    out, _ = curriculum
    s = summary(out, 4)
    adapters = [*s["merged_adapters"], str(out / "phase4" / "adapter")]
    code = evaluate_main(["--model", str(tiny_model_dir), *[a for path in adapters for a in ("--adapter", path)],
                          "--data", str(data[1]), "--json"])
    assert code == 0
    assert_same_fp32_loss(json.loads(capsys.readouterr().out)["loss"], s["eval_loss_after"], "evaluate", tiny_model_dir)
    merged = export_merged(str(tiny_model_dir), adapters, str(tmp_path / "merged"))
    assert evaluate_main(["--model", str(merged), "--data", str(data[1]), "--json"]) == 0
    assert_same_fp32_loss(json.loads(capsys.readouterr().out)["loss"], s["eval_loss_after"], "evaluate merged",
                          tiny_model_dir, merged=True)


def test_an_adapter_is_applied_only_on_what_it_was_trained_on(curriculum, tiny_model_dir, data, tmp_path, capsys):
    """Each adapter records the base and the adapters merged beneath it (lineage.json, by their
    weights): applied without them it is refused, naming them; with them (moved elsewhere, or
    merged into an exported base) it gives its summary's loss; on another base it is warned about."""
    out, _ = curriculum
    text = out / "phase6" / "adapters" / "text"
    expected = summary(out, 6)["adapters"]["text"]["eval_loss_after"]

    def evaluate(model, *adapters):
        code = evaluate_main(["--model", str(model), *[a for path in adapters for a in ("--adapter", str(path))],
                              "--data", str(data[1]), "--json"])
        printed = capsys.readouterr()
        return code, (json.loads(printed.out)["loss"] if code == 0 else None), printed.err

    code, _, err = evaluate(tiny_model_dir, text)  # side by side under init: merge, alone on the raw base
    assert code == 2 and (f"adapter {text} was trained with these adapters merged beneath it: "
                          f"{out / 'phase5' / 'adapter'}; here it would be applied on none") in err
    code, _, err = evaluate(tiny_model_dir, out / "phase4" / "adapter")  # a later phase without phase 2 beneath
    assert code == 2 and f"beneath it: {out / 'phase2' / 'adapter'}; here it would be applied on none" in err
    code, _, err = evaluate(tiny_model_dir, out / "phase5" / "adapter", out / "phase5" / "adapter", text)
    assert code == 2 and "here it would be applied on " in err  # twice beneath is not once

    moved = shutil.copytree(out / "phase5" / "adapter", tmp_path / "moved")
    code, loss, err = evaluate(tiny_model_dir, moved, text)
    assert code == 0 and "warning" not in err
    assert_same_fp32_loss(loss, expected, "moved", tiny_model_dir)
    merged = export_merged(str(tiny_model_dir), [str(moved)], str(tmp_path / "merged"))
    code, loss, err = evaluate(merged, text)
    assert code == 0 and "warning" not in err
    assert_same_fp32_loss(loss, expected, "merged beneath", tiny_model_dir, merged=True)

    other = tmp_path / "other-base"  # the same architecture, other weights
    export_merged(str(tiny_model_dir), [str(out / "phase5" / "adapter")], str(other))
    (other / "lineage.json").unlink()  # as if it came from elsewhere
    code, _, err = evaluate(other, out / "phase1" / "adapter")
    assert code == 0 and (f"warning: adapter {out / 'phase1' / 'adapter'} was trained on {tiny_model_dir}, whose "
                          f"weights differ from this base's ({other})") in err


def test_a_later_phase_resumes_bitwise_and_runs_alone_on_the_earlier_adapters(curriculum):
    """Phase 4 alone, from its step-2 checkpoint: the model is rebuilt on phase 2's adapter
    merged and phase 3's continued, the checkpoint loaded into it, and the two steps after it
    give the uninterrupted run's adapter bit for bit."""
    out, config = curriculum
    adapter = out / "phase4" / "adapter" / "adapter_model.safetensors"
    uninterrupted = load_file(adapter)
    checkpoint = out / "phase4" / "checkpoints" / "step_00000002"
    assert main.main(["--config", str(config), "--phase", "4", "--resume", str(checkpoint)]) == 0
    resumed = load_file(adapter)
    assert resumed.keys() == uninterrupted.keys()
    assert all((resumed[k] == uninterrupted[k]).all() for k in resumed)
    assert summary(out, 4)["resumed_from_step"] == 2


def test_a_phase_run_alone_needs_the_adapters_it_builds_on(curriculum, tmp_path, capsys):
    out, config = curriculum
    code = main.main(["--config", str(config), "--phase", "4", "--resume", "never", "--force",
                      f"output_dir={tmp_path / 'elsewhere'}"])
    assert code == 2 and "phase4.init=continue needs the phase-2 adapter" in capsys.readouterr().err


def test_later_phases_on_two_replica_threads_of_the_tpu_launcher(tiny_model_dir, data, tmp_path):
    """The hard case: the TPU host's launcher (one worker process, two replica threads: the v2/v3
    shape) runs a merge and a continue after phase 1; both threads build each later phase on
    the adapters on disk (the hosts agree on their digests first) and start where the phase
    before ended."""
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out", train={"max_steps": 3},
                              eval={"every": 0, "max_batches": None}, checkpoint={"every": 0},
                              logging={"tensorboard": False}, phase1={"data": str(data[2])},
                              phase2={"data": str(data[2]), "init": "merge"},
                              phase3={"data": str(data[2]), "init": "continue"})
    run = LaunchedRun(["--config", str(config)], tmp_path / "run.log", devices=2)
    assert run.wait(180) == [0], run.output()
    out = tmp_path / "out"
    s = {n: summary(out, n) for n in (1, 2, 3)}
    assert all(s[n]["world_size"] == 2 and s[n]["compiles_after_warmup"] == 0 for n in s), s
    assert_same_fp32_loss(s[2]["eval_loss_before"], s[1]["eval_loss_after"], "merged phase's start", tiny_model_dir,
                          merged=True)
    assert s[3]["eval_loss_before"] == s[2]["eval_loss_after"]  # continued: bit for bit
    assert s[3]["merged_adapters"] == [str(out / "phase1" / "adapter")]
