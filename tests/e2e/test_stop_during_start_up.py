"""A stop signal during a run's start is honoured where it lands, in one line, with nothing
trained and no checkpoint claimed: before the replicas start (the command alone decides), after
they hold output_dir (before the model is built), after the phase's start (its first
evaluation done, before step 1), and at the start of a resumed phase (whose checkpoint stays the
newest). In this process, the signal taken the way main.py's handler takes it; the processes'
own start (main.py's first lines, torchrun's agent, its processes still importing) is held by
test_native_processes' stops during start-up and distributed/test_stop_relay.py."""

from __future__ import annotations

import json
import signal

from trainer_helpers import write_run_config

from finetuning_pipeline import main
from finetuning_pipeline.run.stop_signal import PROCESS_SIGNALS
from finetuning_pipeline.train import phase_loop


def take_sigterm(*args, **kwargs) -> None:
    PROCESS_SIGNALS.handle(signal.SIGTERM, None)  # what main.py's handler does with a SIGTERM


def stop_after(function):
    def wrapped(*args, **kwargs):
        result = function(*args, **kwargs)
        take_sigterm()
        return result
    return wrapped


def test_a_stop_during_start_up_trains_nothing_says_one_line_and_claims_no_checkpoint(
        tiny_model_dir, data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, out,
                              checkpoint={"every": 4, "keep": 4})
    command = ["--config", str(config), "--phase", "1"]

    def stopped(line: str) -> list[str]:
        printed = capsys.readouterr()
        lines = [text for text in printed.out.splitlines() if text.startswith("stopped on")]
        assert lines == [line] and "Traceback" not in printed.err and "error:" not in printed.err, printed
        assert "loss plot" not in printed.out and "replica 0: stopped" not in printed.out, printed.out
        return printed.out.split(line + "\n")[1].splitlines()
    fresh = "stopped on SIGTERM before the first step of phase 1: nothing of it was trained and no checkpoint " \
            "written; the same command starts it:"

    take_sigterm()  # while the command imports and checks its inputs: no replica is started
    assert main.main(command) == 0
    (printed,) = stopped(fresh)
    assert "--resume auto" in printed and not any(out.iterdir())  # (the input checks probed output_dir)

    with monkeypatch.context() as patch:  # once the replica holds output_dir: no model is built
        patch.setattr(main, "check_hosts_agree", take_sigterm)
        assert main.main(command) == 0
    stopped(fresh)
    assert not (out / "phase1").exists()

    with monkeypatch.context() as patch:  # during the phase's start (its first evaluation)
        patch.setattr(phase_loop, "start_phase", stop_after(phase_loop.start_phase))
        assert main.main(command) == 0
    stopped(fresh)
    records = [json.loads(line) for line in (out / "phase1" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [("eval", 0)]
    assert not list((out / "phase1" / "checkpoints").glob("*")) and not (out / "phase1" / "summary.json").exists()

    # The same command, stopped mid-run as ever (a SIGTERM taken while step 4's checkpoint is
    # written: the vote after step 5 stops it, with step 5's checkpoint), then again as it resumes
    with monkeypatch.context() as patch:
        checkpointer = phase_loop.Phase.save
        patch.setattr(phase_loop.Phase, "save", lambda p, step, state=None: (checkpointer(p, step, state),
                                                                              step == 4 and take_sigterm()))
        assert main.main(command) == 0
    assert "stopped on SIGTERM after a checkpoint at step 5 of phase 1" in capsys.readouterr().out
    for moment in ("check_hosts_agree", "start_phase"):
        with monkeypatch.context() as patch:
            if moment == "check_hosts_agree":
                patch.setattr(main, "check_hosts_agree", take_sigterm)
            else:
                patch.setattr(phase_loop, "start_phase", stop_after(phase_loop.start_phase))
            assert main.main(command) == 0
        stopped("stopped on SIGTERM before step 6 of phase 1, nothing trained since its checkpoint at step 5; "
                "resume with:")
        assert sorted(path.name for path in (out / "phase1" / "checkpoints").iterdir()) == ["step_00000004",
                                                                                          "step_00000005"]
    assert main.main(command) == 0  # and the run goes on from it
    summary = json.loads((out / "phase1" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 5 and summary["steps"] == 12
