"""The embedded default config (main.py without --config): its paths, and the demo inputs it builds."""

from __future__ import annotations

from pathlib import Path


def test_the_default_configs_paths_are_anchored_at_the_repository(monkeypatch, tmp_path):
    from finetuning_pipeline.demo.inputs import DEMO_CONFIG, REPO, anchored_paths
    from finetuning_pipeline.main import choose_config

    monkeypatch.chdir(tmp_path)
    anchored = dict(override.split("=", 1) for override in anchored_paths(DEMO_CONFIG, REPO))
    assert anchored == {"output_dir": str(REPO / "outputs/demo"), "model.path": str(REPO / "outputs/demo/base"),
                        "phase1.data": str(REPO / "outputs/demo/data/phase1"),
                        "phase2.data": str(REPO / "outputs/demo/data/phase2"),
                        "phase3.data": str(REPO / "outputs/demo/data/phase3")}
    mine = tmp_path / "mine.yaml"
    monkeypatch.setenv("TPU_LORA_CONFIG", str(mine))
    assert choose_config(None, ["train.lr=1e-3"]) == (mine, ["train.lr=1e-3"])
    assert choose_config("given.yaml", []) == (Path("given.yaml"), [])


def test_the_default_builds_only_the_demo_inputs_this_run_reads(monkeypatch, tmp_path):
    """On a fresh clone `python main.py --phase 1` builds the tiny base and phase 1's data; the
    data only on the demo's own base (it is prepared with its tokenizer), nothing overridden."""
    from finetuning_pipeline.demo import inputs as demo_inputs
    from finetuning_pipeline.run_config import load_config

    paths = {what: tmp_path / what for what in ("base", "phase1", "phase2", "phase3")}
    built = []
    monkeypatch.setattr(demo_inputs, "demo_paths", lambda: paths)
    monkeypatch.setattr(demo_inputs, "build", lambda what, force=False: built.append(what) or 0)

    def config(base, phase1=paths["phase1"], phase2=paths["phase2"]):  # the real config (a stand-in hid a bug)
        return load_config(demo_inputs.DEMO_CONFIG, [f"model.path={base}", f"phase1.data={phase1}",
                                                     f"phase2.data={phase2}"])

    demo_inputs.ensure_demo_inputs(config(paths["base"]), [1])
    assert built == ["base", "phase1"]
    built.clear()
    demo_inputs.ensure_demo_inputs(config(tmp_path / "my-model"), [1, 2])
    assert built == []
    (paths["base"] / "config.json").parent.mkdir()
    (paths["base"] / "config.json").write_text("{}")
    demo_inputs.ensure_demo_inputs(config(paths["base"], phase1=tmp_path / "mine"), [1, 2])
    assert built == ["phase2"]
