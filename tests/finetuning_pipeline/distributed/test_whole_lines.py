"""A TPU launcher worker's replica threads share its stdout and stderr (whole_lines.py): each
thread's line reaches the stream in one write, whatever the others write meanwhile. The run
that depends on it, a stop whose "replica N: stopped" lines are read back, is in
tests/e2e/test_replica_failures.py."""

from __future__ import annotations

import io
import sys
import threading

from finetuning_pipeline.distributed.whole_lines import WholeLines, whole_lines_on_stdout_and_stderr


def test_a_line_another_thread_prints_between_a_text_and_its_newline_stays_whole():
    """print(text) writes text, then its newline: the master's "resume with: ..." was split
    there by a peer replica's "replica 1: stopped ..." (one CI run in many)."""
    stream = io.StringIO()
    lines = WholeLines(stream)
    text_written, peer_printed = threading.Event(), threading.Event()

    def master() -> None:
        lines.write("resume with: main.py --resume auto")
        text_written.set()
        peer_printed.wait()
        lines.write("\n")

    def peer() -> None:
        text_written.wait()
        print("replica 1: stopped after step 3", file=lines, flush=True)
        peer_printed.set()

    threads = [threading.Thread(target=master), threading.Thread(target=peer)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert stream.getvalue() == "replica 1: stopped after step 3\nresume with: main.py --resume auto\n"


def test_threads_printing_at_once_leave_every_line_whole():
    stream = io.StringIO()
    lines = WholeLines(stream)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # a thread switch between almost any two writes
    try:
        def say(rank: int) -> None:
            for step in range(300):
                print("replica", rank, "step", step, file=lines)  # seven writes a line

        threads = [threading.Thread(target=say, args=(rank,)) for rank in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    printed = stream.getvalue().splitlines()
    assert sorted(printed) == sorted(f"replica {rank} step {step}" for rank in range(4) for step in range(300))
    for rank in range(4):  # and each thread's lines in its own order
        assert [line for line in printed if line.startswith(f"replica {rank} ")] == [
            f"replica {rank} step {step}" for step in range(300)]


def test_a_progress_bar_update_shows_at_its_flush_and_a_thread_ended_mid_line_loses_nothing():
    stream = io.StringIO()
    lines = WholeLines(stream)
    lines.write("\r 40%|####      | 4/10")
    assert stream.getvalue() == "\r"
    lines.flush()  # a carriage-return update ends with a flush, not a newline
    assert stream.getvalue() == "\r 40%|####      | 4/10"

    ended = threading.Thread(target=lines.write, args=("warning: no newline",))
    ended.start()
    ended.join()
    lines.write("the next line\n")
    assert stream.getvalue().endswith(" 4/10the next line\n")  # (the bar's line, as on a terminal)
    lines.close_lines()
    assert stream.getvalue().endswith("the next line\nwarning: no newline\n")


def test_the_worker_streams_are_the_processes_own_underneath(capfd):
    before = sys.stdout, sys.stderr
    with whole_lines_on_stdout_and_stderr():
        assert isinstance(sys.stdout, WholeLines) and sys.stdout.stream is before[0]
        assert sys.stderr.fileno() == before[1].fileno() and sys.stdout.encoding == before[0].encoding
        print("held to the end", end="")
        print("to stderr", file=sys.stderr)
    assert (sys.stdout, sys.stderr) == before
    captured = capfd.readouterr()
    assert (captured.out, captured.err) == ("held to the end\n", "to stderr\n")
