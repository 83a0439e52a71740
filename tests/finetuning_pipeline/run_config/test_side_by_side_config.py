"""Adapters side by side in the config: `phaseN.adapters.<name>` sections (data, lr, max_steps),
their overrides, the settings each adapter falls back to, what a resume compares, and every
way such a phase can be written wrong, named by its key."""

from __future__ import annotations

import pytest
import yaml

from finetuning_pipeline.run.resume_plan import is_phase_input, tunable_on_resume
from finetuning_pipeline.run_config import ConfigError, RunConfig, load_config

SIDE_BY_SIDE = """
model: {path: m}
train: {max_steps: 10, lr: 1.0e-3}
phase1:
  lr: 2.0e-3
  adapters:
    sql: {data: d_sql, lr: 3.0e-4, max_steps: 6}
    chat: {data: d_chat}
    code: {data: d_code, max_steps: 12}
phase2: {data: d2, init: fresh}
"""


def side_by_side(tmp_path, *overrides: str, text: str = SIDE_BY_SIDE) -> RunConfig:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_config(path, list(overrides))


def test_each_adapter_has_its_data_lr_and_steps_falling_back_to_the_phase_then_train(tmp_path):
    config = side_by_side(tmp_path)
    assert list(config.phase(1).adapters) == ["sql", "chat", "code"]  # the YAML's order: the rows' order
    assert config.data_dirs(1) == {"sql": "d_sql", "chat": "d_chat", "code": "d_code"}
    assert config.data_dirs(2) == {"default": "d2"}  # a phase of one adapter: PEFT's name for it
    assert list(config.adapters(1)) == ["sql", "chat", "code"] and list(config.adapters(2)) == ["default"]
    assert [config.data_key(n, a) for n in (1, 2) for a in config.data_dirs(n)] == [
        "phase1.adapters.sql.data", "phase1.adapters.chat.data", "phase1.adapters.code.data", "phase2.data"]
    assert [config.adapter_lr(1, n) for n in ("sql", "chat", "code")] == [3e-4, 2e-3, 2e-3]
    assert [config.adapter_max_steps(1, n) for n in ("sql", "chat", "code")] == [6, 10, 12]
    assert config.max_steps(1) == 12  # the phase runs until its longest adapter is done


def test_overrides_reach_an_adapter_and_add_one(tmp_path):
    config = side_by_side(tmp_path, "phase1.adapters.chat.lr=5e-4", "phase1.adapters.math.data=d_math")
    assert config.adapter_lr(1, "chat") == 5e-4
    assert config.data_dirs(1)["math"] == "d_math"
    with pytest.raises(ConfigError, match=r"override phase1\.adapters\.chat\.nope: unknown key .nope. under "
                                          r"phase1\.adapters\.chat"):
        side_by_side(tmp_path, "phase1.adapters.chat.nope=1")


def test_the_config_written_back_loads_as_the_same_config(tmp_path):
    config = side_by_side(tmp_path)
    path = tmp_path / "copy.yaml"
    path.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    assert load_config(path) == config


def test_a_resume_compares_each_adapters_settings_and_lets_its_lr_and_steps_change(tmp_path):
    keys = side_by_side(tmp_path).resume_keys(1)
    assert keys["phase1.adapters.sql.lr"] == 3e-4 and keys["phase1.adapters.code.max_steps"] == 12
    # The set of adapters is a key, their order is not (each one's state is kept by its name).
    assert keys["phase1.adapters"] == ["chat", "code", "sql"]
    assert side_by_side(tmp_path).resume_keys(2)["phase2.adapters"] == ["default"]  # one adapter: a set of one
    assert not tunable_on_resume("phase1.adapters") and is_phase_input("phase1.adapters")
    assert tunable_on_resume("phase1.adapters.sql.lr") and tunable_on_resume("phase1.adapters.sql.max_steps")
    assert not tunable_on_resume("phase1.adapters.sql.data")
    assert is_phase_input("phase1.adapters.sql.data.content")


@pytest.mark.parametrize("overrides, text, message", [
    (["phase1.adapters={solo: {data: d}}"], SIDE_BY_SIDE, r"phase1\.adapters: side by side needs two adapters or more"),
    (["phase1.data=d1"], SIDE_BY_SIDE, r"phase1\.data and phase1\.adapters: one or the other"),
    (["phase1.adapters.sql.lr=0"], SIDE_BY_SIDE, r"phase1\.adapters\.sql\.lr must be > 0"),
    (["phase1.adapters.sql.lr=.nan"], SIDE_BY_SIDE, r"phase1\.adapters\.sql\.lr must be a finite number"),
    (["phase1.adapters.sql.max_steps=0"], SIDE_BY_SIDE, r"phase1\.adapters\.sql\.max_steps must be >= 1"),
    (["phase1.adapters.a/b.data=d"], SIDE_BY_SIDE, r"phase1\.adapters\.a/b: an adapter's name is its output"),
    # 300 characters would train the phase, then fail every checkpoint (File name too long)
    ([f"phase1.adapters.{'x' * 300}.data=d"], SIDE_BY_SIDE,
     r"phase1\.adapters\.x{20}\.\.\. \(300 characters\): an adapter's name is its output directory's: up to 64 "),
    (["phase1.adapters.SQL.data=d"], SIDE_BY_SIDE,
     r"phase1\.adapters: sql and SQL differ only in case, so they would share one directory on a case-insensitive"),
    (["phase2.init=continue"], SIDE_BY_SIDE, r"phase2\.init=continue builds on phase 1's adapter, but phase 1 trains "
                                             r"several side by side \(sql, chat, code\); set phase2\.init=fresh"),
    (["phase2.adapters={a: {data: a}, b: {data: b}}", "phase2.data="], SIDE_BY_SIDE.replace("init: fresh",
                                                                                             "init: continue"),
     r"phase2\.init=continue: adapters side by side start fresh"),
])
def test_a_side_by_side_phase_written_wrong_is_named(tmp_path, overrides, text, message):
    with pytest.raises(ConfigError, match=message):
        side_by_side(tmp_path, *overrides, text=text)


def test_a_merge_chain_through_a_side_by_side_phase_is_refused(tmp_path):
    """phase 3 merges phase 2's adapter, which continues ... nothing side by side: fine; but a
    phase whose chain reaches the side-by-side phase's adapters is refused, whatever the link."""
    with pytest.raises(ConfigError, match=r"phase2\.init=merge builds on phase 1's adapter"):
        side_by_side(tmp_path, "phase2.init=merge")
    config = side_by_side(tmp_path, "phase3.data=d3", "phase3.init=merge")
    assert config.lineage(3) == ([2], None)


def test_an_unknown_key_of_an_adapter_in_the_yaml_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key phase1\.adapters\.sql\.nope"):
        side_by_side(tmp_path, text=SIDE_BY_SIDE.replace("sql: {data: d_sql,", "sql: {data: d_sql, nope: 1,"))


def test_a_side_by_side_phase_alone_needs_no_later_phase_written(tmp_path):
    """Phase 2 not written is no phase: a side-by-side phase 1 alone is a config of its own."""
    config = side_by_side(tmp_path, text=SIDE_BY_SIDE.replace("phase2: {data: d2, init: fresh}\n", ""))
    assert config.phase_numbers() == [1]
