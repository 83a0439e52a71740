"""`model.path` as a Hugging Face user writes it: a local directory, or a Hub id
(`google/gemma-3-270m`) with an optional `model.revision` (branch, tag or commit).

A Hub id is downloaded once into the Hugging Face cache (`HF_HUB_CACHE`, `HF_HOME`), weights
as safetensors and the tokenizer's files only, and resolved to the commit it names, so a run
records exactly which weights it trained on and a resume can refuse another. With
`HF_HUB_OFFLINE=1`, or without a network, the cache is read alone; a model that is not in it
is a ConfigError that says how to download it. A local directory always wins over a Hub id
of the same spelling, as in `from_pretrained`.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

# What a model needs to train, load in transformers and serve: config, weights, tokenizer.
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.jinja", "merges.txt", "vocab.txt"]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
TRUE = {"1", "on", "yes", "true"}


class HubModelError(ValueError):
    """A Hub id that cannot be resolved; the message says why and what to do."""


@dataclass(frozen=True)
class ModelSource:
    """path: what the user wrote; local_dir: where the files are; commit: the Hub commit they
    came from (None for a local directory)."""

    path: str
    local_dir: str
    commit: str | None = None


def is_hub_id(path: str) -> bool:
    return bool(HUB_ID.fullmatch(path)) and not Path(path).exists()


def offline() -> bool:
    """Read at call time: huggingface_hub reads HF_HUB_OFFLINE once, when it is imported."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE


@functools.lru_cache(maxsize=None)
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hub's host (HF_ENDPOINT's) takes a TCP connection, asked once a process:
    without a network huggingface_hub retries every request for about half a minute first."""
    url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout_s).close()
    except OSError:
        return False
    return True


def hub_unavailable() -> bool:
    """Read the Hugging Face cache alone: HF_HUB_OFFLINE is set, or the Hub cannot be reached."""
    return offline() or not hub_reachable()


def hub_cache() -> str | None:
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None


def download_command(repo_id: str, revision: str | None) -> str:
    patterns = " ".join(f"'{p}'" for p in MODEL_FILES)
    return f"hf download {repo_id}{f' --revision {revision}' if revision else ''} --include {patterns}"


def resolve_model(path: str, revision: str | None = None, *, cache_only: bool = False) -> ModelSource:
    """Where `path`'s files are: itself when it is a local directory, else the Hub snapshot of
    `revision` (default "main"), downloaded first unless offline or `cache_only`."""
    if not is_hub_id(path):
        if revision:
            raise HubModelError(f"model.revision: {revision!r} is set but model.path {path} is a local directory, "
                                "not a Hub id; remove model.revision")
        return ModelSource(path, path)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        local_dir = snapshot_download(path, revision=revision, allow_patterns=MODEL_FILES, cache_dir=hub_cache(),
                                      local_files_only=cache_only or hub_unavailable())
    except LocalEntryNotFoundError:
        where = hub_cache() or "the default Hugging Face cache (~/.cache/huggingface/hub)"
        why = "HF_HUB_OFFLINE is set" if offline() else "the Hub cannot be reached"
        raise HubModelError(
            f"model.path: {path} is not a local directory, and as a Hub id (revision {revision or 'main'}) it is "
            f"not in {where} and {why}; download it once "
            f"where there is a network with: {download_command(path, revision)}  (set HF_HUB_CACHE to the same "
            "cache here), or set model.path to a local model directory"
        ) from None
    except RevisionNotFoundError:
        raise HubModelError(
            f"model.revision: {revision!r} is not a branch, tag or commit of {path} on the Hub"
        ) from None
    except GatedRepoError:
        raise HubModelError(
            f"model.path: {path} is gated on the Hub; accept its licence on its page and log in "
            "(`hf auth login`, or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise HubModelError(
            f"model.path: {path} is neither a local directory nor a Hub model you can read (a typo? "
            "a private model needs `hf auth login` or HF_TOKEN)"
        ) from None
    return ModelSource(path, local_dir, Path(local_dir).name)


def model_dir(path: str, revision: str | None = None) -> str:
    """The local directory of `path` (see resolve_model), for code that loads the files. Reads
    the cache only: the command's start-up has already downloaded what it needs."""
    return resolve_model(path, revision, cache_only=True).local_dir
