"""Hugging Face datasets as input (`--format hf`): a local `save_to_disk` directory, local
parquet/JSON/CSV files, or a hub dataset name when the machine is online (streamed, so a
large dataset is never held in memory). Rows come out as plain dicts, numbered from 1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from dataset.errors import DataError

FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}


def open_hf_dataset(source: str, split: str = "train", name: str | None = None):
    """An iterable of rows for `source`; see the module docstring for what `source` may be."""
    import datasets  # imported here: a heavy import only the hf format needs

    path = Path(source)
    try:
        if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()
                              or (path / "state.json").is_file()):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise DataError(f"{source}: no split {split!r} (has {list(loaded)}); pass --split")
                loaded = loaded[split]
            return loaded
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise DataError(f"{source}: unknown file type {path.suffix!r} for --format hf "
                                f"(expected one of {sorted(FILE_BUILDERS)})")
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        if path.exists():
            raise DataError(f"{source}: a directory that is not a `save_to_disk` dataset (no dataset_info.json)")
        if source.startswith((".", "/")) or source.count("/") > 1:
            raise DataError(f"{source}: no such file or directory")
        return datasets.load_dataset(source, name, split=split, streaming=True)
    except DataError:
        raise
    except Exception as err:  # datasets raises many types (network, missing split, bad file)
        raise DataError(f"{source}: could not open as a Hugging Face dataset: {type(err).__name__}: {err}") from None


def iter_hf_records(source: str, split: str = "train", name: str | None = None) -> Iterator[tuple[int, dict]]:
    for index, row in enumerate(open_hf_dataset(source, split, name), start=1):
        yield index, dict(row)
