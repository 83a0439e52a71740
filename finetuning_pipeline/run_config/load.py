"""Building the RunConfig from YAML and dotted `key=value` overrides, with the key (and the
file) named in every error. Override values are parsed as YAML scalars, so `train.lr=3e-4`,
`model.activation_checkpointing=true` and `lora.target_modules=[q_proj,v_proj]` all work."""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from pathlib import Path

import yaml

from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.run_config.schema import PhaseConfig, RunConfig, phase_number
from finetuning_pipeline.run_config.validate import validate
from utils.yaml_file import read_yaml_mapping


def _choice(value, choices: tuple, key: str):
    """The choice `value` names: itself, a word in any case ("FULL" is full), or 0 and 1 where the
    choices are false and true (as YAML's yes, on and true are). A boolean where none is a choice is
    YAML's reading of on/off, yes/no or true/false, and said to be."""
    for choice in choices:
        if type(choice) is type(value) and choice == value:
            return choice
    if isinstance(value, str):
        for choice in choices:
            if isinstance(choice, str) and choice.lower() == value.strip().lower():
                return choice
    if type(value) is int and value in (0, 1) and any(isinstance(choice, bool) for choice in choices):
        return bool(value)
    names = [str(choice).lower() if isinstance(choice, bool) else str(choice) for choice in choices]
    read_as = (" (YAML reads on/off, yes/no and true/false as booleans: write one of the words above)"
               if isinstance(value, bool) else "")
    raise ConfigError(f"{key} must be {', '.join(names[:-1])} or {names[-1]}, got {value!r}{read_as}")


def _coerce(value, annotation, key: str):
    """Check `value` against a field's annotation; ints are accepted where floats are expected."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:  # every choice of every setting is checked here
        return _choice(value, args, key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if origin is dict:  # named sections (phaseN.adapters): {name: section}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of names to sections, got {value!r}")
        return {str(name): _build(args[1], section if section is not None else {}, f"{key}.{name}.")
                for name, section in value.items()}
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        try:  # PyYAML reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if annotation in (int, float, str, bool):
        if not isinstance(value, annotation) or (annotation is int and isinstance(value, bool)):
            raise ConfigError(f"{key}: expected {annotation.__name__}, got {value!r}")
        return value
    return value


def yaml_keys(cls) -> tuple[set[str], list[str]]:
    """(the keys a section's mapping takes, the keys an error lists): RunConfig.phases is
    written as phase1:, phase2:, ... sections (_build_run_config), not as a `phases` key."""
    keys = {f.name for f in dataclasses.fields(cls) if not (cls is RunConfig and f.name == "phases")}
    return keys, sorted(keys) + (["phase1", "phase2", "..."] if cls is RunConfig else [])


def _build_run_config(data: dict) -> RunConfig:
    """RunConfig from its YAML mapping (overrides applied): the `phaseN` sections written become
    RunConfig.phases, phase1 to the last, with none missing in between (a config without any
    has one empty phase, for its errors to name phase1's keys)."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping, got {data!r}")
    rest = {key: value for key, value in data.items() if phase_number(key) is None}
    sections = {phase_number(key): value for key, value in data.items() if phase_number(key) is not None}
    last = max(sections, default=1)
    missing = [n for n in range(1, last + 1) if n not in sections]
    if sections and missing:
        written = ", ".join(f"phase{n}" for n in sorted(sections))
        raise ConfigError(f"phase{missing[0]}: missing; the config has {written}, and phases run in order from "
                          f"phase1: write a phase{missing[0]}: section, or number the phases from 1 without a gap")
    first = sections.get(1)
    if isinstance(first, dict) and first.get("init") == "merge":  # (continue, the default, is written back for it)
        raise ConfigError("phase1.init=merge: phase 1 has no earlier phase to build on; it always trains "
                          "a fresh adapter on the base. Remove phase1.init (init says how a later phase starts: "
                          "phase2.init=continue, merge or fresh)")
    config = _build(RunConfig, rest, "")
    config.phases = [_build(PhaseConfig, sections.get(n, {}), f"phase{n}.") for n in range(1, last + 1)]
    return config


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known, shown = yaml_keys(cls)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown key {prefix}{unknown[0]}; known keys under {prefix or 'the top level'}: {shown}")
    kwargs = {}
    for name, value in data.items():
        annotation = hints[name]
        if dataclasses.is_dataclass(annotation):
            kwargs[name] = _build(annotation, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, annotation, f"{prefix}{name}")
    try:
        return cls(**kwargs)
    except ValueError as err:  # a section's own checks (LoraConfig's) name their keys
        raise ConfigError(str(err)) from None


def apply_override(data: dict, override: str) -> None:
    """Apply one `dotted.key=value` to the nested dict `data` (value parsed as YAML)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r}: expected key=value, e.g. train.max_steps=100")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    parts = renamed(key).split(".")
    node = data
    cls = RunConfig
    section_of = None
    for depth, part in enumerate(parts):
        names, shown = yaml_keys(cls) if cls is not None else ((), [])
        if cls is RunConfig and phase_number(part) is not None:
            annotation = PhaseConfig  # phaseN.key=value, any N: a phase the YAML lacks is added
        elif cls is None:  # a name in a mapping of named sections (phaseN.adapters.<name>): any name
            annotation = section_of
        elif part not in names:
            where = ".".join(parts[:depth]) or "the top level"
            raise ConfigError(f"override {key}: unknown key {part!r} under {where}; known: {shown}")
        else:
            annotation = typing.get_type_hints(cls)[part]
        if depth == len(parts) - 1:
            node[part] = value
        elif typing.get_origin(annotation) is dict:
            node = node.setdefault(part, {})
            cls, section_of = None, typing.get_args(annotation)[1]
        else:
            if not dataclasses.is_dataclass(annotation):
                raise ConfigError(f"override {key}: {'.'.join(parts[: depth + 1])} is not a section")
            node = node.setdefault(part, {})
            cls = annotation


def read_config_file(path: str | Path) -> dict:
    """The YAML mapping in `path`; every way a file can fail to be one is a ConfigError naming it."""
    data = read_yaml_mapping(path, ConfigError, "a mapping of sections (model:, train:, ...)")
    if data is None:
        raise ConfigError(f"{path}: the config is empty; start from one in finetuning_pipeline/configs/ "
                          "(at least model.path and phase1.data / phase2.data)")
    for old in RENAMED:
        section, name = old.split(".")
        if isinstance(data.get(section), dict) and name in data[section]:
            data[section][renamed(old).split(".")[1]] = data[section].pop(name)
    return data


# Keys that were renamed: the old name still works, with a note saying the new one.
RENAMED = {"model.gradient_checkpointing": "model.activation_checkpointing"}


def renamed(key: str) -> str:
    if key in RENAMED:
        print(f"note: {key} is now called {RENAMED[key]}; the old name still works", file=sys.stderr)
        return RENAMED[key]
    return key


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """The validated RunConfig from a YAML file (or defaults) and dotted overrides."""
    data = read_config_file(path) if path is not None else {}
    try:
        for override in overrides:
            apply_override(data, override)
        config = _build_run_config(data)
        validate(config)
    except ConfigError as err:
        raise ConfigError(f"{source_of(str(err), path, overrides)}{err}") from None
    return config


def source_of(message: str, path: str | Path | None, overrides: list[str]) -> str:
    """Where the value an error names came from, as its prefix: the last override that set the key
    the message names (it wins over the file), else the file; nothing for an override's own error."""
    if message.startswith("override "):
        return ""
    for override in reversed(overrides):
        key = override.partition("=")[0]
        if re.search(rf"(?<![\w.]){re.escape(RENAMED.get(key, key))}(?![\w])", message):
            return f"override {override}: "
    return f"{path}: " if path else ""
