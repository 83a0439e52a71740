"""manifest.json: what a prepared dataset was built from, so a mismatch is caught before a TPU.

The trainer compares the manifest's `seq_len` and tokenizer fingerprint with its own and
refuses to train on shards made by another tokenizer or for another sequence length.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from dataset.chat_samples import chat_template_of
from dataset.errors import DataError

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over what decides the token ids: the tokenizer's full definition (vocab, merges,
    normalizer, added tokens), its special-token ids and the chat template. Paths and file
    layout do not enter it, so a copied tokenizer has the same fingerprint."""
    definition = tokenizer.backend_tokenizer.to_str()
    special = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
        "unk": tokenizer.unk_token_id,
    }
    payload = json.dumps(
        {"tokenizer": definition, "special": special, "chat_template": chat_template_of(tokenizer)},
        sort_keys=True,
    )
    return "sha256:" + hashlib.sha256(payload.encode("utf-8")).hexdigest()


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise DataError(f"{path}: no manifest; is {directory} the output of `python -m dataset.prepare`?")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err}); re-run `python -m dataset.prepare`") from None


def check_manifest(manifest: dict, *, fingerprint: str, seq_len: int, source: str = MANIFEST_NAME,
                   setting: str = "the run's seq_len", new_tokens: list[str] | None = None) -> None:
    """Refuse shards that do not match the trainer's tokenizer or seq_len, naming both values
    and `setting`, the config key the expected seq_len came from. new_tokens: the run's
    model.new_tokens (a tokenizer that differs by them is named so)."""
    if manifest.get("seq_len") != seq_len:
        raise DataError(
            f"{source}: shards were packed for seq_len {manifest.get('seq_len')}, but the run uses seq_len "
            f"{seq_len} ({setting} is {seq_len}); re-run prepare with --seq-len {seq_len}, or set "
            f"{setting}={manifest.get('seq_len')}"
        )
    theirs = manifest.get("tokenizer", {}).get("fingerprint")
    prepared_with = manifest.get("tokenizer", {}).get("new_tokens") or []
    if theirs != fingerprint and new_tokens is not None and prepared_with != list(new_tokens):
        fix = (f"re-run prepare with --new-tokens {' '.join(new_tokens)}" if new_tokens
               else "re-run prepare without --new-tokens")
        raise DataError(
            f"{source}: shards were tokenized with new tokens {prepared_with or 'none'}, but the run's "
            f"model.new_tokens are {list(new_tokens) or 'none'}: the same words are other token ids; {fix}, or set "
            f"model.new_tokens=[{','.join(prepared_with)}]"
        )
    if theirs != fingerprint:
        raise DataError(
            f"{source}: shards were tokenized by tokenizer {theirs}, but the run's tokenizer is {fingerprint}; "
            "re-run prepare with the run's tokenizer"
        )


def content_digest(manifest: dict) -> str:
    """A short digest of what decides a prepared dataset's blocks: its sources (with their
    sha256), options, tokenizer fingerprint and counts; not where the tokenizer was read from.
    Preparing again from the same inputs gives the same digest; other inputs, another."""
    content = {k: v for k, v in manifest.items() if k != "tokenizer"}
    content["tokenizer"] = {k: v for k, v in manifest.get("tokenizer", {}).items() if k != "path"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def is_packed(manifest: dict) -> bool:
    """Phase-2 blocks pack separate conversations; phase-1 blocks are one stream of text."""
    return manifest["phase"] == 2
