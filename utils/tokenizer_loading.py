"""Load a Hugging Face tokenizer from a local directory, with an error that says what is wrong.

AutoTokenizer's own errors mislead here: a model directory without tokenizer files says to
install sentencepiece or tiktoken, a missing directory talks about repo ids. Used by every
command that reads a tokenizer (prepare, the trainer's checks, evaluate, generate, export).
"""

from __future__ import annotations

from pathlib import Path

# Any one of these lets AutoTokenizer build a tokenizer (fast JSON, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


class TokenizerError(ValueError):
    """A tokenizer directory that is missing, has no tokenizer files, or does not load."""


def load_tokenizer(path: str | Path, setting: str):
    """The tokenizer in `path`; setting: how the user named it (e.g. "model.tokenizer", "--tokenizer")."""
    from transformers import AutoTokenizer

    directory = Path(path)
    if not directory.is_dir():
        raise TokenizerError(f"{setting}: {path} is not a directory (a local tokenizer or model directory is expected)")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise TokenizerError(f"{setting}: {path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); copy "
                             "them from the model's download, or point the setting at the directory that holds them")
    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError, ... for broken files
        raise TokenizerError(f"{setting}: cannot load the tokenizer in {path} ({type(err).__name__}: {err})") from None


def add_new_tokens(tokenizer, tokens: list[str], setting: str) -> list[int]:
    """Extend `tokenizer` with `tokens` (model.new_tokens, prepare's --new-tokens), in order, as
    ordinary added tokens (matched before the model's own pieces, as `tokenizer.add_tokens`
    does); returns their ids, the tokenizer's next ones. A token that is empty, listed twice or
    already one token of the vocabulary is an error naming it (it would be silently skipped)."""
    tokens = list(tokens or [])
    if not tokens:
        return []
    vocabulary = tokenizer.get_vocab()
    problems = [f"{t!r} is not a non-empty string" for t in tokens if not isinstance(t, str) or not t]
    problems += [f"{t!r} is listed twice" for i, t in enumerate(tokens) if t in tokens[:i]]
    problems += [f"{t!r} is already a token (id {vocabulary[t]})" for t in dict.fromkeys(tokens)
                 if isinstance(t, str) and t in vocabulary]
    if problems:
        raise TokenizerError(f"{setting}: " + "; ".join(problems[:5]) + ": list only tokens the tokenizer lacks")
    first = len(tokenizer)
    tokenizer.add_tokens(tokens)
    ids = tokenizer.convert_tokens_to_ids(tokens)
    if ids != list(range(first, first + len(tokens))):
        raise TokenizerError(f"{setting}: the tokenizer gave the new tokens ids {ids[:5]}, not the next ones "
                             f"({first}...); a tokenizer whose added tokens are not numbered after its vocabulary is "
                             "not supported")
    return ids


def load_extended_tokenizer(path: str | Path, setting: str, new_tokens: list[str] | None, new_setting: str):
    """load_tokenizer, then add_new_tokens(new_tokens) (new_setting: how the user named them)."""
    tokenizer = load_tokenizer(path, setting)
    add_new_tokens(tokenizer, new_tokens or [], new_setting)
    return tokenizer
