"""The host memory a piece of work takes: its process's anonymous and resident memory, sampled
every 5 ms while it runs (/proc/self/status), as the growth of each over its value before."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


def memory_mib() -> dict[str, float]:
    """This process's anonymous and resident memory now, in MiB."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "VmRSS"):
                fields[name] = int(value.split()[0]) / 1024
    return fields


@contextlib.contextmanager
def peak_growth() -> Iterator[dict[str, int]]:
    """Yields a dict that holds, once the block ends, the peaks' growth in MiB: anonymous_peak_mib
    (what the host must really have: it cannot be reclaimed) and rss_peak_mib (anonymous plus the
    files' pages read, which the kernel drops when memory runs short)."""
    before = memory_mib()
    peaks = dict(before)
    done = threading.Event()

    def sample():
        while not done.wait(0.005):
            for name, value in memory_mib().items():
                peaks[name] = max(peaks[name], value)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    figures: dict[str, int] = {}
    try:
        yield figures
    finally:
        done.set()
        sampler.join()
        figures["anonymous_peak_mib"] = round(peaks["RssAnon"] - before["RssAnon"])
        figures["rss_peak_mib"] = round(peaks["VmRSS"] - before["VmRSS"])
