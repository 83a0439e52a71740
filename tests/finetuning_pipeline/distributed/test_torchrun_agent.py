"""main.py's own torchrun agent (distributed/torchrun_agent.py): what it says of torchrun's
failures, and the error line each process hands it (errors.say_error). The whole path, stops and
kills included, runs in tests/e2e/test_native_processes.py."""

from __future__ import annotations

import json
import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from finetuning_pipeline import main
from finetuning_pipeline.distributed.torchrun_agent import report_failures
from finetuning_pipeline.errors import ERRORS_TO_AGENT, ConfigError, run_command

pytestmark = pytest.mark.native  # (make test-native: under torch 2.13 too)


def failure(tmp_path, rank: int, exitcode: int, line: str | None = None) -> ProcessFailure:
    error_file = tmp_path / f"error-{rank}-{exitcode}.json"
    if line is not None:
        error_file.write_text(json.dumps({"message": line, "timestamp": 0}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


def test_the_same_refusal_of_every_process_is_one_line_with_its_exit_status(tmp_path, capsys):
    line = "error: data.path: /nowhere does not exist"
    assert report_failures({0: failure(tmp_path, 0, 2, line), 1: failure(tmp_path, 1, 2, line)}, 2) == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_a_line_that_only_follows_from_the_masters_is_left_to_it(tmp_path, capsys):
    """A busy output_dir: the master names the run that holds it, its peer only that it followed;
    one line, the master's (docs/reliability.md promises one error line)."""
    masters = ("error: output_dir: /out is in use by another run (pid 7 on host vm, started 2026-11-29T12:10:56); "
               "wait for it to finish, stop it, or choose another output_dir")
    follows = "error: output_dir: /out is in use by another run (see the master's error)"
    assert report_failures({0: failure(tmp_path, 0, 2, masters), 1: failure(tmp_path, 1, 2, follows)}, 2) == 2
    assert capsys.readouterr().err.splitlines() == [masters]
    assert report_failures({1: failure(tmp_path, 1, 2, follows)}, 2) == 2  # (alone: said as it is)
    assert capsys.readouterr().err.splitlines() == [follows]


def test_a_killed_process_is_named_and_the_first_failure_gives_the_status(tmp_path, capsys):
    lost = "error: replica 0: another replica stopped answering (Connection closed by peer)"
    killed = ("error: process 1 of 2 was killed by SIGKILL; the run resumes from its last complete checkpoint with "
              "--resume auto")
    # the killed one is the cause: its peer's line, which followed from it, is left out (torch 2.13 reports both)
    assert report_failures({1: failure(tmp_path, 1, -signal.SIGKILL), 0: failure(tmp_path, 0, 3, lost)}, 2) == 3
    assert capsys.readouterr().err.splitlines() == [killed]
    assert report_failures({0: failure(tmp_path, 0, 3, lost)}, 2) == 3  # (alone: said as it is)
    assert capsys.readouterr().err.splitlines() == [lost]
    # a process that left no line of ours (a bug's traceback, printed by itself): its status, pointed at
    assert report_failures({0: failure(tmp_path, 0, 1)}, 4) == 1
    assert capsys.readouterr().err.splitlines() == ["error: process 0 of 4 exited with status 1 (its output is above)"]
    assert report_failures({}, 2) == 0
    # the agent's own SIGTERM to the others, once one failed, is not theirs to answer for
    assert report_failures({0: failure(tmp_path, 0, -signal.SIGTERM), 1: failure(tmp_path, 1, -signal.SIGKILL)}, 2) == 3
    assert capsys.readouterr().err.splitlines() == ["error: process 1 of 2 was killed by SIGKILL; the run resumes "
                                                    "from its last complete checkpoint with --resume auto"]
    assert report_failures({0: failure(tmp_path, 0, -signal.SIGTERM)}, 2) == 3  # (alone: a `kill` of it)
    assert "process 0 of 2 was killed by SIGTERM" in capsys.readouterr().err


def test_a_process_of_the_agent_hands_its_line_to_torchruns_error_file_and_says_nothing(tmp_path, monkeypatch,
                                                                                       capsys):
    def refuse():
        raise ConfigError("lora.r: expected a positive integer")

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert run_command(refuse) == 2
    assert "lora.r" in capsys.readouterr().err and not (tmp_path / "error.json").exists()  # plain torchrun: printed
    monkeypatch.setenv(ERRORS_TO_AGENT, "1")
    assert run_command(refuse) == 2
    assert capsys.readouterr().err == ""
    said = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(tmp_path / "error.json"))
    assert said.message == "error: lora.r: expected a positive integer"  # as torchelastic reads it back


def test_the_process_count_is_checked_against_torchruns(monkeypatch):
    with pytest.raises(ConfigError, match="--nproc-per-node 0: expected a count"):
        main.check_process_count(0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="one of torchrun's 4 on this node; leave the flag out"):
        main.check_process_count(2)
    main.check_process_count(4)  # (a process of main.py's own agent: the flag it was started with)
    main.check_process_count(1)
