"""The embedded default's inputs are built once when several processes of one command need them at
once (`torchrun ... main.py` without --config): the first builds, the others find them built."""

from __future__ import annotations

import threading
import time

from finetuning_pipeline.demo import inputs
from finetuning_pipeline.run_config import load_config


def test_processes_that_need_the_demo_inputs_at_once_build_each_once(tmp_path, monkeypatch):
    paths = {"base": tmp_path / "demo" / "base", "phase1": tmp_path / "demo" / "data" / "phase1",
             "phase2": tmp_path / "demo" / "data" / "phase2"}
    built = []

    def build(what: str, force: bool = False) -> int:  # as slow as a build, then what it leaves
        built.append(what)
        time.sleep(0.3)
        paths[what].mkdir(parents=True, exist_ok=True)
        (paths[what] / ("config.json" if what == "base" else "manifest.json")).write_text("{}")
        return 0

    monkeypatch.setattr(inputs, "demo_paths", lambda: paths)
    monkeypatch.setattr(inputs, "build", build)
    config = load_config(inputs.DEMO_CONFIG, [f"model.path={paths['base']}", f"phase1.data={paths['phase1']}"])
    failures = []

    def process() -> None:  # (a thread stands for a process: flock holds across both)
        try:
            inputs.ensure_demo_inputs(config, [1])
        except Exception as err:
            failures.append(err)

    workers = [threading.Thread(target=process) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert failures == [] and sorted(built) == ["base", "phase1"]
