"""Read a YAML file that must hold a mapping, with an error naming the file for every way it
can fail to: missing, a directory, not UTF-8, unreadable, invalid YAML, a key given twice in one
mapping, or another type. Shared by the run config (finetuning_pipeline/run_config/schema.py)
and prepare's --config."""

from __future__ import annotations

from pathlib import Path

import yaml


class DuplicateKey(yaml.YAMLError):
    """A key given twice in one mapping: (key, line of the first, line of the second)."""


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping: PyYAML keeps the last
    silently, so a second `train:` section would drop the first's settings, and an adapter
    listed twice would train once."""

    def construct_mapping(self, node, deep=False):
        first_line = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` merges keys an explicit one may override
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first_line.get(key)
            except TypeError:  # an unhashable key: the base constructor says so
                break
            if seen is not None:
                raise DuplicateKey(key, seen, key_node.start_mark.line + 1)
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, UniqueKeyLoader.construct_mapping)


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
        data = yaml.load(text, Loader=UniqueKeyLoader)
    except DuplicateKey as err:
        key, first, second = err.args
        raise error(f"{path}: line {first} and line {second} both set {key!r} in one mapping; YAML would keep only "
                    "the second. Remove one (or merge them)") from None
    except yaml.YAMLError as err:
        raise error(f"{path}: invalid YAML: {err}") from None
    if data is not None and not isinstance(data, dict):
        raise error(f"{path}: expected {expected}, got a {type(data).__name__}: {data!r:.80}")
    return data
