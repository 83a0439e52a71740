"""A notebook cell shows a command's output as it comes, not when the command ends."""

from __future__ import annotations

import pytest

from finetuning_pipeline.demo.streamed import run_python

# Prints a line, then waits (up to 60 s) for the file that only the caller's echo of that line
# writes: it can finish only if its line reached the caller while it was still running.
WAITS_FOR_ITS_LINE_TO_BE_SEEN = """
import pathlib, sys, time
seen = pathlib.Path(sys.argv[1])
print("step 1 of a long phase")
deadline = time.time() + 60
while not seen.exists():
    if time.time() > deadline:
        sys.exit("the caller never saw the line")
    time.sleep(0.01)
print("done")
"""


def test_each_line_is_shown_while_the_command_runs(tmp_path):
    seen, shown = tmp_path / "seen", []

    def echo(line):
        shown.append(line)
        if line == "step 1 of a long phase":
            seen.touch()

    printed = run_python("-c", WAITS_FOR_ITS_LINE_TO_BE_SEEN, str(seen), echo=echo)
    assert printed == "step 1 of a long phase\ndone\n"
    assert shown[1:] == ["step 1 of a long phase", "done"] and shown[0].startswith("$ python -c")


def test_a_failure_raises_with_its_stderr_and_keeps_it_off_stdout(tmp_path):
    shown = []
    with pytest.raises(RuntimeError, match=r"exit 3: python -c .*\nbad input in line 7"):
        run_python("-c", "import sys; print('partial'); sys.stderr.write('bad input in line 7\\n'); sys.exit(3)",
                   echo=shown.append)
    assert shown[1:] == ["partial"]
