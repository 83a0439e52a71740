"""Read a YAML file that must hold a mapping, with an error naming the file for every way it
can fail to: missing, a directory, not UTF-8, unreadable, invalid YAML, or another type.
Shared by the run config (finetuning_pipeline/run_config/schema.py) and prepare's --config."""

from __future__ import annotations

from pathlib import Path

import yaml


def read_yaml_mapping(path: str | Path, error: type[Exception], expected: str) -> dict | None:
    """The mapping in `path`, or None when the file holds no document (empty, comments only).
    error: the exception class to raise; expected: what the mapping holds, for the message."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: no such config file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory; --config takes a YAML file") from None
    except UnicodeDecodeError as err:
        raise error(f"{path}: not UTF-8 text (byte {err.start}); save the config as UTF-8 YAML") from None
    except OSError as err:
        raise error(f"{path}: cannot read the config ({err.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise error(f"{path}: invalid YAML: {err}") from None
    if data is not None and not isinstance(data, dict):
        raise error(f"{path}: expected {expected}, got a {type(data).__name__}: {data!r:.80}")
    return data
