"""Staged outputs (utils/output_guard.py) under stop signals and dead processes: a SIGTERM or SIGINT
while an output is staged removes what was staged; a later run removes what a dead process staged,
and leaves a live one's alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from utils.output_guard import (
    OutputConflict,
    claim_output,
    remove_stale_staging,
    staged_directory,
    staged_file,
    staging_path,
)

# Stages `out`, writes part of it, signals itself; the exception the signal raised ends the block,
# and the script reports it as a command does (utils/interrupts.py).
STAGE_AND_SIGNAL = """
import os, signal, sys
from pathlib import Path
from utils.output_guard import staged_directory, staged_file
out, kind, sig = Path(sys.argv[1]), sys.argv[2], getattr(signal, sys.argv[3])
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal gives it (a background job's is ignored)
try:
    with (staged_directory(out) if kind == "dir" else staged_file(out)) as staging:
        (staging / "half" if kind == "dir" else staging).write_bytes(b"half of it")
        os.kill(os.getpid(), sig)
        print("not reached", flush=True)
except KeyboardInterrupt as err:
    print(f"unwound: {getattr(err, 'signal_name', 'SIGINT')}", flush=True)
    sys.exit(getattr(err, "exit_code", 130))
"""


@pytest.mark.parametrize("kind", ["file", "dir"])
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_while_an_output_is_staged_removes_the_staging(tmp_path, kind, sig):
    """SIGTERM runs the `finally` that removes the staging (left to end the process where it
    stood, it would leave gigabytes behind for a 7B export)."""
    out = tmp_path / ("model.gguf" if kind == "file" else "merged")
    done = subprocess.run([sys.executable, "-c", STAGE_AND_SIGNAL, str(out), kind, sig], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == f"unwound: {sig}", done
    assert done.returncode == {"SIGTERM": 143, "SIGINT": 130}[sig]
    assert list(tmp_path.iterdir()) == []


def test_a_dead_process_staging_is_removed_by_the_next_run_and_a_live_one_is_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    out = tmp_path / "model.gguf"
    left_file = out.with_name(f".model.gguf.partial-{dead_pid}")
    left_file.write_bytes(b"half")
    live = out.with_name(f".model.gguf.partial-{os.getppid()}")  # another process at work on it
    live.write_bytes(b"in progress")
    unrelated = tmp_path / ".model.gguf.partial-notapid"
    unrelated.write_bytes(b"not ours to judge")
    with staged_file(out) as staging:
        staging.write_bytes(b"whole")
    assert out.read_bytes() == b"whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, live.name, unrelated.name])

    directory = tmp_path / "merged"
    left_dir = directory.with_name(f".merged.partial-{dead_pid}")
    (left_dir / "sub").mkdir(parents=True)
    (left_dir / "sub" / "model.safetensors").write_bytes(b"half")
    with staged_directory(directory) as staging:
        (staging / "config.json").write_text("{}")
    assert not left_dir.exists() and (directory / "config.json").is_file()


def test_only_the_outputs_own_stagings_are_removed(tmp_path):
    """Names are matched literally: an output whose name holds glob characters removes its own
    leftovers only, not those of outputs its pattern would match."""
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    out = tmp_path / "m[1].gguf"
    mine = out.with_name(f".m[1].gguf.partial-{dead}")
    other = tmp_path / f".m1.gguf.partial-{dead}"
    mine.write_bytes(b"x")
    other.write_bytes(b"y")
    assert remove_stale_staging(out) == [mine]
    assert other.exists() and staging_path(out).name == f".m[1].gguf.partial-{os.getpid()}"


@pytest.mark.parametrize("stage", [staged_file, staged_directory])
def test_a_write_that_fails_takes_back_the_directories_it_made(tmp_path, stage):
    """A failed write leaves none of the empty directories made for its output."""
    (tmp_path / "kept").mkdir()
    out = tmp_path / "kept" / "made" / "also made" / "out"
    with pytest.raises(OSError), stage(out):
        raise OSError(28, "No space left on device")
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*")] == [Path("kept")]
    with stage(out) as staging:  # and one that succeeds keeps them
        (staging / "x" if stage is staged_directory else staging).write_text("whole")
    assert out.exists()


def test_claim_output_refuses_what_the_file_system_would_refuse(tmp_path):
    for out in (tmp_path / ("n" * 300), tmp_path / ("d" * 256) / "out", tmp_path / ("n" * 250)):
        with pytest.raises(OutputConflict, match="the file system takes names of 255 bytes at most"):
            claim_output(out, force=False, command="test")
    claim_output(tmp_path / ("n" * 200), force=False, command="test")
    with pytest.raises(OutputConflict, match="over the file system's 4096"):
        claim_output(tmp_path / "/".join(["d" * 200] * 21), force=False, command="test")
    assert list(tmp_path.iterdir()) == []
