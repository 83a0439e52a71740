"""A Hugging Face tokenizer as llama.cpp's tokenizer reads it from GGUF: its tokens, their scores
and types, the BPE merges and pre-tokenizer, the special tokens and the chat template.

Three kinds of tokenizer, as llama.cpp's converter tells them apart:
- a sentencepiece model file (`tokenizer.model`: Llama 2, Mistral, Gemma): llama.cpp's `llama`
  tokenizer, each piece's score and type read from the model;
- sentencepiece's BPE saved as tokenizer.json only (byte fallback, a Metaspace pre-tokenizer: what
  transformers 5 writes for such a tokenizer): the same `llama` tokenizer; its scores, which
  rank the merges in llama.cpp, are the merges' order (the first merge scores highest), as
  sentencepiece's BPE scores its pieces;
- byte-level BPE (Llama 3, Qwen): llama.cpp's `gpt2` tokenizer with the merges, and its
  pre-tokenizer named by the split regex tokenizer.json gives (`PRE_TOKENIZERS`).
Every id the model's embedding has gets a token: ids the tokenizer lacks are written as unused
`[PADn]`, as the converter does. The special tokens, add_bos/add_eos and the chat template come
from gguf-py's SpecialVocab (tokenizer.json, tokenizer_config.json, chat_template.jinja).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import gguf

# The split regexes of byte-level tokenizers as tokenizer.json writes them, and the name by which
# llama.cpp (llama-vocab.cpp) knows the same pre-tokenizer.
LLAMA3_SPLIT, QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|" + digits +
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    for digits in (r"\p{N}{1,3}", r"\p{N}"))
PRE_TOKENIZERS = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
T = gguf.TokenType


@dataclass
class GgufVocab:
    """What the writer puts in the file; `model` is llama.cpp's tokenizer model."""

    model: str
    pre: str
    tokens: list[bytes]
    types: list[int]
    scores: list[float] | None = None
    add_space_prefix: bool | None = None
    notes: list[str] = field(default_factory=list)


def read_vocab(directory: str | Path, vocab_size: int, flag: str = "--tokenizer") -> GgufVocab:
    """The tokenizer in `directory` for a model whose embedding has `vocab_size` rows; a
    ValueError naming the file and what it lacks when llama.cpp could not read it the same way."""
    directory = Path(directory)
    if (directory / "tokenizer.model").is_file():
        vocab = sentencepiece_vocab(directory / "tokenizer.model")
    else:
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{flag} {directory}: neither tokenizer.model nor tokenizer.json; GGUF needs the "
                             "tokenizer (pass --tokenizer DIR)")
        data = json.loads(path.read_text(encoding="utf-8"))
        model = data.get("model", {})
        if model.get("type") != "BPE":
            raise ValueError(f"{path}: a {model.get('type')} tokenizer; the GGUF export writes sentencepiece and "
                             "BPE tokenizers")
        vocab = merges_ranked_vocab(path, data) if model.get("byte_fallback") else byte_level_vocab(path, data)
    with_added_tokens(vocab, directory)
    if vocab.model == "llama":
        space_prefix(vocab, directory)
    if len(vocab.tokens) > vocab_size:
        raise ValueError(f"{flag} {directory}: {len(vocab.tokens)} tokens, but the model's embedding has "
                         f"{vocab_size} rows: this tokenizer is not the model's")
    for index in range(len(vocab.tokens), vocab_size):  # ids the embedding has and the tokenizer never gives
        vocab.tokens.append(f"[PAD{index}]".encode())
        vocab.types.append(T.UNUSED)
        if vocab.scores is not None:
            vocab.scores.append(-1000.0)
    return vocab


def sentencepiece_vocab(path: Path) -> GgufVocab:
    from sentencepiece import SentencePieceProcessor
    from sentencepiece import sentencepiece_model_pb2 as model_pb2

    processor = SentencePieceProcessor()
    processor.LoadFromFile(str(path))
    proto = model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    tokens, scores, types = [], [], []
    kinds = {1: T.NORMAL, 2: T.UNKNOWN, 3: T.CONTROL, 4: T.USER_DEFINED, 5: T.UNUSED, 6: T.BYTE}
    for piece in proto.pieces:
        tokens.append(piece.piece.encode("utf-8"))
        scores.append(piece.score)
        types.append(kinds.get(piece.type, T.NORMAL))
    return GgufVocab("llama", "default", tokens, types, scores,
                     add_space_prefix=proto.normalizer_spec.add_dummy_prefix)


def merges_ranked_vocab(path: Path, data: dict) -> GgufVocab:
    """sentencepiece's BPE as tokenizer.json holds it: each merged piece scores minus its merge's
    rank, so llama.cpp, merging the highest score first, merges in the merges' order."""
    vocab = data["model"]["vocab"]
    rank = {"".join(merge if isinstance(merge, list) else merge.split(" ")): index
            for index, merge in enumerate(data["model"].get("merges", []))}
    size = max(vocab.values()) + 1
    tokens, scores, types = [b""] * size, [0.0] * size, [T.UNUSED] * size
    unknown = data["model"].get("unk_token")
    for text, index in vocab.items():
        tokens[index] = text.encode("utf-8")
        scores[index] = -float(rank[text]) if text in rank else 0.0
        types[index] = (T.BYTE if BYTE_TOKEN.fullmatch(text) else T.UNKNOWN if text == unknown else T.NORMAL)
    return GgufVocab("llama", "default", tokens, types, scores)


def byte_level_vocab(path: Path, data: dict) -> GgufVocab:
    pre = pre_tokenizer_name(path, data.get("pre_tokenizer") or {})
    vocab = data["model"]["vocab"]
    size = max(vocab.values()) + 1
    tokens, types = [b""] * size, [T.UNUSED] * size
    for text, index in vocab.items():
        tokens[index], types[index] = text.encode("utf-8"), T.NORMAL
    return GgufVocab("gpt2", pre, tokens, types)


def pre_tokenizer_name(path: Path, pre: dict) -> str:
    """llama.cpp's name for the pre-tokenizer of a byte-level tokenizer.json."""
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    splits = [step["pattern"].get("Regex") for step in steps if step.get("type") == "Split"]
    if not splits and any(step.get("type") == "ByteLevel" and step.get("use_regex", True) for step in steps):
        return "gpt-2"
    if len(splits) == 1 and splits[0] in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[splits[0]]
    raise ValueError(f"{path}: its pre-tokenizer {json.dumps(pre)[:200]} is none that the GGUF export knows "
                     f"llama.cpp's name for ({', '.join(sorted(set(PRE_TOKENIZERS.values())))}, gpt-2): llama.cpp "
                     "would split text otherwise than transformers")


def space_prefix(vocab: GgufVocab, directory: Path) -> None:
    """Whether llama.cpp puts sentencepiece's '▁' before a text, from tokenizer.json's Metaspace
    where there is one (what transformers runs), else from the sentencepiece model.

    llama.cpp puts it at the start and after every special token, or nowhere. transformers'
    prepend_scheme "first" (Llama 2's and Mistral's tokenizers with legacy=False) puts it before
    the text's first word only: that is written as nowhere, so chat-formatted text, which starts
    with a special token, tokenizes as transformers does; a text that starts with a word differs
    in that word only (stated as a note)."""
    path = directory / "tokenizer.json"
    pre = (json.loads(path.read_text(encoding="utf-8")).get("pre_tokenizer") or {}) if path.is_file() else {}
    if pre.get("type") != "Metaspace":
        return
    scheme = pre.get("prepend_scheme", "always")
    vocab.add_space_prefix = scheme == "always"
    if scheme == "first":
        vocab.notes.append("the tokenizer puts '▁' before a text's first word only (prepend_scheme first), "
                           "which llama.cpp cannot: written as never, so text that starts with a special token "
                           "(a chat template's) tokenizes as in transformers, and a text that starts with a word "
                           "lacks that word's '▁' in llama.cpp")


def with_added_tokens(vocab: GgufVocab, directory: Path) -> None:
    """tokenizer.json's added tokens in their ids: special ones as control tokens, the others as
    user-defined (both are matched whole by llama.cpp before the model's tokenizer runs)."""
    path = directory / "tokenizer.json"
    added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens", []) if path.is_file() else []
    for token in added:
        index = token["id"]
        while index >= len(vocab.tokens):
            vocab.tokens.append(f"[PAD{len(vocab.tokens)}]".encode())
            vocab.types.append(T.UNUSED)
            if vocab.scores is not None:
                vocab.scores.append(-1000.0)
        text = token["content"]
        if not token.get("special") and vocab.model == "llama":
            text = text.replace("\u2581", " ")  # llama.cpp matches user-defined tokens in plain text
        vocab.tokens[index] = text.encode("utf-8")
        vocab.types[index] = T.CONTROL if token.get("special") else T.USER_DEFINED
        if vocab.scores is not None:
            vocab.scores[index] = -1000.0


def write_vocab(writer: gguf.GGUFWriter, vocab: GgufVocab, directory: str | Path, tokenizer) -> None:
    """The vocabulary, and what the Hugging Face `tokenizer` (loaded from `directory`) adds around a text."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    special = gguf.SpecialVocab(Path(directory), load_merges=vocab.model == "gpt2", n_vocab=len(vocab.tokens))
    # What the tokenizer does, not what its files suggest: llama.cpp's own default (a BOS for its
    # llama tokenizer) would otherwise stand wherever tokenizer.json's post-processor is silent.
    special.add_special_token.update(added_around_text(tokenizer))
    special.add_to_gguf(writer, quiet=True)


def added_around_text(tokenizer) -> dict[str, bool]:
    """Whether `tokenizer` puts its BOS before, and its EOS after, a text it encodes."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return {"bos": bos is not None and full[:1] == [bos] and plain[:1] != [bos],
            "eos": eos is not None and full[-1:] == [eos] and plain[-1:] != [eos]}
