"""A worker process's stdout and stderr, shared by its replica threads, write every line whole.

`print(text)` writes `text` and its newline in two calls, and Python lets another thread write in
between: the master's "resume with: ..." and a peer's "replica 1: stopped after step N" then run
into one line, which neither a user nor a log parser can read. Each thread's text is held here
until its newline (or an explicit flush, as a progress bar's carriage-return update does) and
then written in one call, under a lock.
"""

from __future__ import annotations

import contextlib
import sys
import threading


class WholeLines:
    """`stream`, with each thread's lines written whole; anything else (fileno, isatty,
    encoding) is the stream's own."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self._lock = threading.RLock()  # (a signal handler that prints runs on the thread it interrupts)
        self._held: dict[int, str] = {}  # by thread: its text since its last line end

    def write(self, text: str) -> int:
        with self._lock:
            held = self._held.pop(threading.get_ident(), "") + text
            end = max(held.rfind("\n"), held.rfind("\r")) + 1
            if end < len(held):
                self._held[threading.get_ident()] = held[end:]
            if end:
                self.stream.write(held[:end])
        return len(text)

    def flush(self) -> None:
        """This thread's held text, then the stream's flush."""
        with self._lock:
            self.stream.write(self._held.pop(threading.get_ident(), ""))
            self.stream.flush()

    def close_lines(self) -> None:
        """Every thread's held text, each on a line of its own: a thread that ended mid-line
        (it raised, or a library printed without a newline) loses nothing."""
        with self._lock:
            for text in self._held.values():
                self.stream.write(text + "\n")
            self._held.clear()
            self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def whole_lines_on_stdout_and_stderr():
    """sys.stdout and sys.stderr as WholeLines for the block; the text any thread still holds
    at its end is written then."""
    previous = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = WholeLines(sys.stdout), WholeLines(sys.stderr)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.close_lines()
        sys.stdout, sys.stderr = previous
