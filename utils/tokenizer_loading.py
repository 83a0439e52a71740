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
