"""A command run from a notebook cell with its output shown as it comes: a phase that trains
for hours prints a line per log step (logging.progress_bar=false), and the cell shows each one
then, not all of them at the end."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile


def run_python(*args: str, echo=print) -> str:
    """`python ARGS` in this interpreter: each line of its stdout passed to `echo` as soon as it
    is printed; returns the whole stdout. A failure raises RuntimeError with its stderr's tail
    (kept aside, so that a command's answer on stdout is not mixed with its warnings)."""
    echo(f"$ python {' '.join(args)}")
    with tempfile.TemporaryFile("w+", encoding="utf-8") as errors:
        proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=errors, text=True,
                                bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines = []
        with proc.stdout:
            for line in proc.stdout:
                echo(line.rstrip("\n"))
                lines.append(line)
        if proc.wait() != 0:
            errors.seek(0)
            raise RuntimeError(f"exit {proc.returncode}: python {' '.join(args)}\n{errors.read()[-3000:]}")
    return "".join(lines)
