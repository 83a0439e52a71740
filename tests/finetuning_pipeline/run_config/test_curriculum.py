"""A curriculum of any length: `phaseN:` sections (and `phaseN.key=value` overrides) for any N,
what each phase is built on (its `init` down the chain), and `--phase N` for any phase."""

from __future__ import annotations

import pytest
import yaml

from finetuning_pipeline.main import selected_phases
from finetuning_pipeline.run_config import ConfigError, RunConfig, load_config

FOUR = """
model: {path: m}
phase1: {data: d1}
phase2: {data: d2, init: continue, lr: 1.0e-4}
phase3: {data: d3, init: merge, max_steps: 7}
phase4: {data: d4, init: fresh, seq_len: 128}
"""


def four_phases(tmp_path, *overrides: str) -> RunConfig:
    path = tmp_path / "four.yaml"
    path.write_text(FOUR)
    return load_config(path, list(overrides))


def test_phase_sections_of_any_number_load_in_order_and_take_overrides(tmp_path):
    config = four_phases(tmp_path, "phase3.lr=3e-4", "phase5.data=d5", "phase5.init=merge")
    assert [p.data for p in config.phases] == ["d1", "d2", "d3", "d4", "d5"]
    assert config.phase_numbers() == [1, 2, 3, 4, 5]
    assert [config.max_steps(n) for n in (2, 3)] == [config.train.max_steps, 7]
    assert [config.lr(n) for n in (1, 2, 3)] == [config.train.lr, 1e-4, 3e-4]
    assert config.phase(4).seq_len == 128 and config.phase(5).init == "merge"
    assert config.phase(1) is config.phases[0] and config.phase(2) is config.phases[1]


def test_the_config_written_back_is_its_yaml(tmp_path):
    """to_dict writes the phases as the YAML's own sections: a rehearsal's or W&B's copy of the
    config loads again as the same config."""
    config = four_phases(tmp_path)
    data = config.to_dict()
    assert "phases" not in data and [data[f"phase{n}"]["data"] for n in (1, 2, 3, 4)] == ["d1", "d2", "d3", "d4"]
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(data))
    assert load_config(again) == config


def test_a_config_has_the_phases_it_writes_and_no_gap(tmp_path):
    """A phase-1-only config runs phase 1 alone under --phase all (no empty phase 2: "phase2.data:
    not set"), and phase1 + phase3 names the missing phase."""
    path = tmp_path / "one.yaml"
    path.write_text("model: {path: m}\nphase1: {data: d1}\n")
    assert load_config(path).phase_numbers() == [1]
    assert load_config(path, ["phase2.data=d2"]).phase_numbers() == [1, 2]  # an override adds a phase
    gap = tmp_path / "gap.yaml"
    gap.write_text("model: {path: m}\nphase1: {data: d1}\nphase3: {data: d3}\n")
    with pytest.raises(ConfigError, match=r"phase2: missing; the config has phase1, phase3, and phases run in order "
                                          r"from phase1: write a phase2: section"):
        load_config(gap)
    assert load_config(gap, ["phase2.data=d2"]).phase_numbers() == [1, 2, 3]


@pytest.mark.parametrize("text, override, message", [
    ("phase3: {data: d3, nope: 1}", None, "unknown key phase3.nope"),
    ("phases: [{data: d1}]", None, "unknown key phases"),
    ("phase0: {data: d0}", None, "unknown key phase0"),
    ("phase3: {data: d3, init: later}", None, "phase3.init must be continue, merge or fresh"),
    ("phase3: {data: d3}", "phase3.max_steps=0", "phase3.max_steps must be >= 1"),
    ("phase3: {data: d3}", "phase4.lr=.nan", "phase4.lr must be a finite number"),
    ("phase3: {data: d3}", "phase3.colour=red", "override phase3.colour: unknown key 'colour' under phase3"),
])
def test_a_bad_later_phase_names_its_key(tmp_path, text, override, message):
    path = tmp_path / "bad.yaml"
    path.write_text(f"model: {{path: m}}\nphase1: {{data: d1}}\nphase2: {{data: d2}}\n{text}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path, [override] if override else [])


@pytest.mark.parametrize("inits, lineage", [
    # phase 2..N's init -> (adapters merged beneath phase N, the adapter phase N continues)
    ([], ([], None)),
    (["continue"], ([], 1)),
    (["merge"], ([1], None)),
    (["fresh"], ([], None)),
    (["continue", "continue", "continue"], ([], 3)),
    (["merge", "merge", "merge"], ([1, 2, 3], None)),
    (["continue", "merge"], ([2], None)),  # phase 2's adapter already carries phase 1's training
    (["merge", "continue"], ([1], 2)),
    (["merge", "fresh", "merge"], ([3], None)),  # fresh: back on the untouched base
    (["merge", "merge", "continue", "merge"], ([1, 2, 4], None)),
])
def test_each_phase_is_built_on_what_the_inits_before_it_say(inits, lineage):
    config = RunConfig()
    config.phases = [config.phase(1), *[type(config.phase(1))(data=f"d{n}", init=init) for n, init in
                                      enumerate(inits, start=2)]] if inits else config.phases
    assert config.lineage(len(inits) + 1) == lineage


def test_phase_selection_takes_any_phase_of_the_config(tmp_path):
    config = four_phases(tmp_path)
    assert selected_phases("all", config) == [1, 2, 3, 4]
    assert selected_phases("3", config) == [3]
    for wrong in ("5", "0", "two", "-1"):
        with pytest.raises(ConfigError, match=rf"--phase {wrong}: expected all or a phase of the config: 1, 2, 3, 4"):
            selected_phases(wrong, config)
