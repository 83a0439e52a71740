"""A trainer process's start-up without Python's cyclic garbage collector.

Importing torch, torch_xla and transformers makes a few million objects, and the collector, run
every 700 new objects, walks the older ones again and again while they are made: with it paused,
those imports took 7.1 s instead of 10.0 s on 2 cores (farm-bench, median of 4 paired runs;
docs/development.md). Every trainer process pays them: the command, each worker the TPU
launcher spawns, each torchrun process. `pause_collector` runs first thing in such a process;
`resume_collector` once its replica starts, which first moves what start-up built out of the
collector's reach for good (gc.freeze: modules, classes, functions; never garbage, and never
walked again by a step's collections).
"""

from __future__ import annotations

import gc

_paused = False


def pause_collector() -> None:
    """At the start of a process of its own (never in one that imported the trainer as a library)."""
    global _paused
    gc.disable()
    _paused = True


def resume_collector() -> None:
    """The collector back on, after start-up; nothing where `pause_collector` was not called."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
