"""utils/startup.py: the collector paused for a trainer process's start-up, back on after it
with start-up frozen, and untouched in a process that never paused it (the tests, a library user)."""

from __future__ import annotations

import gc

from utils import startup


def test_the_collector_is_paused_then_resumed_with_start_up_frozen():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    try:
        startup.pause_collector()
        assert not gc.isenabled()
        kept = [[] for _ in range(1000)]  # start-up's objects
        startup.resume_collector()
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(kept)
        startup.resume_collector()  # a second replica thread's call: nothing more
        assert gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
        gc.freeze()  # (conftest's freeze, as it was)


def test_resume_without_a_pause_changes_nothing(monkeypatch):
    """Nothing frozen, nothing switched: the freeze and enable calls are watched, not the freeze
    count, which a frozen object freed meanwhile lowers (another test's threads in this worker did)."""
    calls = []
    for name in ("freeze", "unfreeze", "enable", "disable"):
        monkeypatch.setattr(startup.gc, name, lambda name=name: calls.append(name))
    startup.resume_collector()
    assert calls == [] and gc.isenabled()
