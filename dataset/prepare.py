"""`python -m dataset.prepare`: validate, tokenize, mask and pack a dataset once, on CPU.

    python -m dataset.prepare --format messages --input chat.jsonl --tokenizer MODEL_DIR \
        --seq-len 512 --out data/phase2 [--phase 2] [--eval-fraction 0.05] [--skip-invalid]

or the same keys from YAML (`--config prep.yaml`; command-line flags win). Writes, under OUT:
  train/, eval/      input_ids.npy, labels.npy, position_ids.npy: int32 [N, seq_len], mmap-able
                     (preference pairs: chosen_input_ids, chosen_labels, rejected_input_ids,
                     rejected_labels, [pairs, seq_len]: dataset/preference.py)
  manifest.json      phase, seq_len, tokenizer fingerprint, sources with sha256, counts
  stats.json         records read / kept / skipped by reason, tokens, truncated, fill ratio

Bad records: by default the first `max_errors` problems are printed as FILE:LINE: reason and
the command exits with status 2, writing nothing. `--skip-invalid` skips them, counts them
by reason in stats.json, and carries on. The output directory appears only when complete
(it is built next to OUT and renamed into place).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from dataset.accounting import RecordAccounts
from dataset.chat_samples import ChatRenderer
from dataset.encode import IGNORE_INDEX, encode_conversations, encode_documents
from dataset.errors import DataError, InvalidRecord, RecordIssue
from dataset.formats import PHASE_OF_FORMAT, RECORD_FORMATS, detect_format, normalize, remap_columns
from dataset.hf_source import iter_hf_records
from dataset.manifest import MANIFEST_NAME, MANIFEST_VERSION, read_manifest, tokenizer_fingerprint
from dataset.packing import BestFitPacker, StreamPacker
from dataset.preference import fit_pair, normalize_preference, pair_block, tokenize_pair
from dataset.readers import SourceFile, iter_file_records
from dataset.shards import PREFERENCE, SplitWriter, arrays_of
from utils.atomic_io import atomic_write_json
from utils.hub_models import HubModelError, resolve_model
from utils.interrupts import report_interrupted, stop_signals_unwind
from utils.output_guard import OutputConflict, claim_output, staged_directory
from utils.tokenizer_loading import TokenizerError, load_extended_tokenizer
from utils.yaml_file import read_yaml_mapping

FORMATS = (*RECORD_FORMATS, "hf", "auto")
# Tokenizing holds about this many bytes per input character (Rust encodings and Python id
# lists; measured ~80 above the ~0.7 GB the imports take, for records of 4 and 12 million
# characters), so prepare's memory is bounded by the characters of one tokenizer batch: at
# most CHARS_PER_BATCH plus the longest record, which max_record_chars caps.
BYTES_PER_CHAR = 100
CHARS_PER_BATCH = 2_000_000
OVERLONG_POLICIES = ("truncate", "drop")


# The longest block prepare writes where the model states no context length: longer than any
# model's context today (Llama 4 Scout's 10M), and 192 MiB of int32 arrays a block.
MAX_SEQ_LEN = 1 << 24


@dataclass
class PrepareOptions:
    """Options of `prepare`; the YAML keys are these names, the flags their dashed forms.

    inputs: input files (or, with format hf, dataset directories / files / hub names).
    tokenizer: a Hugging Face tokenizer directory (usually the base model's).
    seq_len: tokens per packed block; the trainer must use the same.
    out: output directory.
    format: text | messages | alpaca | preference | hf | auto (detected per file from its first record).
    phase: 1 (causal LM on every token) or 2 (assistant tokens only); default from the format
        (preference pairs are their own kind: "preference" in the manifest).
    eval_fraction: share of records held out for eval, drawn deterministically from `seed`.
    skip_invalid: skip and count bad records instead of stopping at them.
    seed: seeds the train/eval draw.
    overlong: phase 2 conversations longer than seq_len are truncated or dropped (counted
        either way). Phase 1 documents never are: they are concatenated and cut into blocks.
    max_prompt_len: preference pairs: a prompt keeps its last max_prompt_len tokens (default half
        of seq_len), then each row its first seq_len (dataset/preference.py); cut pairs are counted.
    columns: our field name -> the input's column name, e.g. {"text": "content"}.
    split / hf_name: the split and config name for format hf.
    max_errors: how many problems to report before stopping (strict mode).
    max_record_chars: a longer record is a problem (reason record_too_long: reported, or skipped
        and counted), because tokenizing one record needs ~BYTES_PER_CHAR bytes per character;
        the default (4 million characters, a long book) keeps prepare near 1 GB.
    batch_size: records tokenized per batch (the tokenizer spreads a batch over all cores).
    force: replace an existing OUT that an earlier prepare wrote (never anything else, and OUT
        may never overlap an input or the tokenizer).
    new_tokens: tokens added to the tokenizer before tokenizing (the run's model.new_tokens, in
        the same order: utils/tokenizer_loading.add_new_tokens); the manifest's fingerprint covers
        them, so a run without them refuses the data, and the other way round.
    """

    inputs: list[str] = field(default_factory=list)
    tokenizer: str = ""
    seq_len: int = 0
    out: str = ""
    format: str = "auto"
    phase: int | None = None
    eval_fraction: float = 0.05
    skip_invalid: bool = False
    seed: int = 0
    overlong: str = "truncate"
    max_prompt_len: int | None = None
    columns: dict[str, str] = field(default_factory=dict)
    split: str = "train"
    hf_name: str | None = None
    max_errors: int = 10
    max_record_chars: int = 4_000_000
    batch_size: int = 1024
    force: bool = False
    quiet: bool = False
    new_tokens: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.inputs, str):
            self.inputs = [self.inputs]
        if not self.inputs:
            raise DataError("inputs: no input given (--input FILE, repeatable)")
        for key in ("tokenizer", "out"):
            if not getattr(self, key):
                raise DataError(f"{key}: required (--{key})")
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or not 8 <= self.seq_len <= MAX_SEQ_LEN:
            raise DataError(f"seq_len: must be an integer from 8 to {MAX_SEQ_LEN:,} (each block is three int32 arrays "
                            f"of seq_len values), got {self.seq_len!r} (--seq-len)")
        if self.format not in FORMATS:
            raise DataError(f"format: {self.format!r} is not one of {list(FORMATS)}")
        if self.phase not in (None, 1, 2):
            raise DataError(f"phase: must be 1 or 2, got {self.phase!r}")
        if self.format in PHASE_OF_FORMAT and self.phase not in (None, PHASE_OF_FORMAT[self.format]):
            raise DataError(
                f"phase: format {self.format} is phase {PHASE_OF_FORMAT[self.format]} data, but phase {self.phase} "
                "was asked for"
            )
        if not isinstance(self.eval_fraction, (int, float)) or not 0 <= self.eval_fraction < 1:
            raise DataError(f"eval_fraction: must be in [0, 1), got {self.eval_fraction!r}")
        if self.overlong not in OVERLONG_POLICIES:
            raise DataError(f"overlong: must be one of {list(OVERLONG_POLICIES)}, got {self.overlong!r}")
        if not isinstance(self.columns, dict):
            raise DataError(f"columns: must be a mapping of our field name to the input's, got {self.columns!r}")
        if self.max_prompt_len is None:
            self.max_prompt_len = self.seq_len // 2
        for key in ("max_errors", "batch_size", "max_record_chars", "max_prompt_len"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DataError(f"{key}: must be an integer >= 1, got {value!r} (--{key.replace('_', '-')})")


class TooManyErrors(Exception):
    pass


@dataclass
class Sample:
    file_index: int
    split: str
    payload: object  # str (document), list of turns (conversation) or PreferencePair
    path: str  # where the record came from, for a problem found when it is tokenized
    line: int


def check_seq_len(seq_len: int, tokenizer_dir: str | Path) -> None:
    """Refuse blocks longer than the model's context length (max_position_embeddings in the
    config.json beside the tokenizer: a base model's directory), before any block is allocated."""
    try:
        config = json.loads((Path(tokenizer_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # a tokenizer alone: MAX_SEQ_LEN bounds it
    if not isinstance(config, dict):
        return
    context = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    if isinstance(context, int) and seq_len > context:
        raise DataError(f"--seq-len {seq_len:,}: longer than the model's context length ({context:,} tokens, "
                        f"max_position_embeddings in {Path(tokenizer_dir) / 'config.json'}); choose at most {context}")


class Preparation:
    """One run of prepare: reads, accounts, tokenizes, packs and writes. `run()` returns stats."""

    def __init__(self, options: PrepareOptions) -> None:
        self.options = options
        tokenizer_dir = resolve_model(options.tokenizer).local_dir  # or a Hub id
        check_seq_len(options.seq_len, tokenizer_dir)
        self.tokenizer = load_extended_tokenizer(tokenizer_dir, "--tokenizer", options.new_tokens, "--new-tokens")
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id  # the usual fallback; pads are masked anyway
        self.render = ChatRenderer(self.tokenizer)
        self.accounts = RecordAccounts()
        self.issues: list[RecordIssue] = []
        self.sources: list[dict] = []
        self.phase = options.phase or PHASE_OF_FORMAT.get(options.format)
        self.detected: dict[str, str] = {}  # path -> format found by auto-detection
        self.current_source: SourceFile | None = None
        self.bytes_done = 0  # bytes of the input files already read to the end
        self.draw = random.Random(options.seed)
        self.tokens = 0
        self.samples = 0  # phase 2: a conversation is one sample, or one per answer (chat_samples.py)
        self.samples_skipped = Counter()  # phase 2: overlong samples dropped, by reason (a kept record's too)
        self.pending: list[Sample] = []
        self.writers: dict[str, SplitWriter] = {}  # per split, made with the packers (take)
        self.pending_chars = 0

    # -- reading and validation ------------------------------------------------------------
    def iter_records(self) -> Iterator[tuple[int, str, int, object]]:
        """(file index, path, line, record or RecordIssue) over every input, in order."""
        for name in self.options.inputs:
            file_index = self.accounts.add_file(name)
            if self.options.format == "hf":
                rows = iter_hf_records(name, self.options.split, self.options.hf_name)
                source = None
            else:
                source = SourceFile(name)
                rows = iter_file_records(source)
            self.current_source = source
            seen = 0
            for line, value in rows:
                seen += 1
                yield file_index, name, line, value
            if seen == 0:
                self.accounts.empty_files.append(name)
                self.report(file_index, RecordIssue(name, 0, "empty_file", "empty file (no records)"), counted=False)
            if source is not None:
                self.sources.append({"path": str(source.path), "sha256": source.sha256, "bytes": source.bytes_read})
                self.bytes_done += source.bytes_read
                self.current_source = None
            else:
                self.sources.append({"path": name, "kind": "hf", "split": self.options.split})

    def format_of(self, path: str, record: dict) -> str | None:
        """The record format: explicit, or detected once per file from its first recognisable record."""
        if self.options.format in RECORD_FORMATS:
            return self.options.format
        if path in self.detected:
            return self.detected[path]
        detected = detect_format(record)
        if detected is None:
            return None
        if self.phase is None:
            self.phase = PHASE_OF_FORMAT[detected]
        elif PHASE_OF_FORMAT[detected] != self.phase:
            raise DataError(
                f"{path}: its records look like {detected} (phase {PHASE_OF_FORMAT[detected]} data) but this "
                f"dataset is phase {self.phase}; prepare each phase's data separately"
            )
        self.detected[path] = detected
        return detected

    def report(self, file_index: int, issue: RecordIssue, counted: bool = True) -> None:
        if counted:
            self.accounts.skip(file_index, issue.reason)
        if not self.options.skip_invalid:
            self.issues.append(issue)
            if len(self.issues) >= self.options.max_errors:
                raise TooManyErrors

    # -- tokenization and packing ----------------------------------------------------------
    def flush_pending(self) -> None:
        if not self.pending:
            return
        batch, self.pending, self.pending_chars = self.pending, [], 0
        if self.phase == PREFERENCE:
            for sample in batch:
                self.take_pair(sample)
            return
        if self.phase == 1:
            encoded = encode_documents(self.tokenizer, [s.payload for s in batch])
            for sample, ids in zip(batch, encoded):
                self.accounts.keep(sample.file_index)
                self.samples += 1
                self.tokens += len(ids)
                self.write(sample.split, self.packers[sample.split].add(ids))
            return
        encoded = encode_conversations(self.tokenizer, [s.payload for s in batch], self.render)
        for sample, outcome in zip(batch, encoded):
            if isinstance(outcome, InvalidRecord):
                self.report(sample.file_index, RecordIssue(sample.path, sample.line, outcome.reason, outcome.detail))
                continue
            fates = [self.take_sample(sample.split, ids, labels) for ids, labels in outcome]
            self.samples_skipped.update(fate for fate in fates if fate is not None)
            if None in fates:
                self.accounts.keep(sample.file_index)
            else:  # every sample of the record was dropped: the record is skipped, with the reason
                self.accounts.skip(sample.file_index, fates[-1])

    def take_sample(self, split: str, ids: np.ndarray, labels: np.ndarray) -> str | None:
        """Pack one phase-2 sample (truncated or dropped when overlong); the skip reason, or None."""
        limit = self.options.seq_len
        if len(ids) > limit:
            if self.options.overlong == "drop":
                return "overlong_dropped"
            ids, labels = ids[:limit], labels[:limit]
            if not (labels != IGNORE_INDEX).any():
                return "overlong_no_answer_left"
            self.accounts.truncated += 1
        self.samples += 1
        self.tokens += len(ids)
        self.write(split, self.packers[split].add(ids, labels))
        return None

    def take_pair(self, sample: Sample) -> None:
        """Tokenize one preference pair as TRL does, cut it to shape and write its block: kept
        (truncated: counted), skipped with its reason when no completion token is left, or a
        problem when it cannot be tokenized into one."""
        options = self.options
        try:
            (prompt, chosen, rejected), cut = fit_pair(*tokenize_pair(self.tokenizer, sample.payload),
                                                        options.seq_len, options.max_prompt_len)
        except InvalidRecord as err:
            if err.reason == "no_completion_left":  # a shape's outcome, as phase 2's overlong answers
                self.accounts.skip(sample.file_index, err.reason)
                return
            self.report(sample.file_index, RecordIssue(sample.path, sample.line, err.reason, err.detail))
            return
        self.accounts.keep(sample.file_index)
        self.accounts.truncated += cut
        self.samples += 1
        self.tokens += 2 * len(prompt) + len(chosen) + len(rejected)
        self.writers[sample.split].write(pair_block(prompt, chosen, rejected, options.seq_len, self.pad_id),
                                         2 * len(prompt) + len(chosen) + len(rejected))

    def write(self, split: str, blocks) -> None:
        for block, real_tokens in blocks:
            self.writers[split].write(block, real_tokens)

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> dict:
        options = self.options
        out = Path(options.out)
        inputs = {"--tokenizer": options.tokenizer, **{f"--input {name}": name for name in options.inputs}}
        claim_output(out, force=options.force, command="dataset.prepare", inputs=inputs, ours=is_prepared_dir)
        started = time.perf_counter()
        progress = Progress(options)
        try:
            with staged_directory(out) as staging:
                self.staging = staging  # the writers are made there with the packers, once the phase is known
                self.packers = None
                try:
                    for file_index, path, line, value in self.iter_records():
                        self.take(file_index, path, line, value, progress, started)
                    self.flush_pending()  # the last batch: its records may be problems too
                except TooManyErrors:
                    pass
                if self.issues:
                    raise DataError(format_issues(self.issues, options.max_errors))
                if self.packers is None or not self.tokens:
                    raise DataError(f"no usable records in {options.inputs}; stats: "
                                    f"{self.accounts.as_dict()['skipped_by_reason']}")
                for split, packer in self.packers.items():
                    self.write(split, packer.flush())
                for writer in self.writers.values():
                    writer.close()
                progress.update(self, started)
                self.accounts.check_balanced()
                stats = self.stats(time.perf_counter() - started)
                atomic_write_json(staging / MANIFEST_NAME, self.manifest())
                atomic_write_json(staging / "stats.json", stats)
            return stats
        finally:
            progress.close()

    def take(self, file_index: int, path: str, line: int, value, progress: "Progress", started: float) -> None:
        """One input record: counted, then reported (a problem) or queued for tokenizing."""
        options = self.options
        self.accounts.read(file_index)
        if isinstance(value, RecordIssue):
            self.report(file_index, value)
            return
        record = remap_columns(value, options.columns)
        record_format = self.format_of(path, record)
        if record_format is None:
            self.report(file_index, RecordIssue(path, line, "unknown_format",
                                                "record has none of the fields text, messages, instruction/output or "
                                                "chosen/rejected (map yours with --column)"))
            return
        try:
            if record_format == "preference":
                payload = normalize_preference(record)
            else:
                payload = normalize(record, record_format)
        except InvalidRecord as err:
            self.report(file_index, RecordIssue(path, line, err.reason, err.detail))
            return
        chars = payload_chars(payload)
        if chars > options.max_record_chars:
            self.report(file_index, RecordIssue(
                path, line, "record_too_long",
                f"{chars:,} characters, over max_record_chars ({options.max_record_chars:,}): tokenizing "
                f"needs about {BYTES_PER_CHAR} bytes of memory per character of a record. Split it into "
                "several records, or raise --max-record-chars if the memory is there"))
            return
        if self.packers is None:  # the first record to keep: the phase is known (given, or detected)
            self.packers = make_packers(self.phase, options.seq_len, self.pad_id)
            self.writers = {split: SplitWriter(self.staging / split, options.seq_len, arrays_of(self.phase))
                            for split in ("train", "eval")}
        split = "eval" if self.draw.random() < options.eval_fraction else "train"
        self.pending.append(Sample(file_index, split, payload, path, line))
        self.pending_chars += chars
        if len(self.pending) >= options.batch_size or self.pending_chars >= CHARS_PER_BATCH:
            self.flush_pending()
            progress.update(self, started)

    def manifest(self) -> dict:
        tok = self.tokenizer
        return {
            "version": MANIFEST_VERSION,
            "created_by": "dataset.prepare",
            "phase": self.phase,
            "format": self.options.format,
            "detected_formats": dict(self.detected),
            "seq_len": self.options.seq_len,
            "tokenizer": {
                "path": str(self.options.tokenizer),
                "fingerprint": tokenizer_fingerprint(tok),
                "vocab_size": len(tok),
                "bos_id": tok.bos_token_id,
                "eos_id": tok.eos_token_id,
                "pad_id": self.pad_id,
                "new_tokens": list(self.options.new_tokens),
            },
            "sources": self.sources,
            "counts": {split: w.rows for split, w in self.writers.items()},
            "seed": self.options.seed,
            "eval_fraction": self.options.eval_fraction,
            "overlong": self.options.overlong,
            **({"max_prompt_len": self.options.max_prompt_len} if self.phase == PREFERENCE else {}),
        }

    def stats(self, seconds: float) -> dict:
        splits = {}
        rows_per_block = 2 if self.phase == PREFERENCE else 1  # a pair's block: its chosen and rejected rows
        for split, w in self.writers.items():
            capacity = w.rows * self.options.seq_len * rows_per_block
            splits[split] = {
                "blocks": w.rows,
                "tokens": w.tokens,
                "label_tokens": w.label_tokens,
                "fill_ratio": round(w.tokens / capacity, 4) if capacity else 0.0,
            }
        all_capacity = sum(s["blocks"] for s in splits.values()) * self.options.seq_len * rows_per_block
        return {
            "phase": self.phase,
            "seq_len": self.options.seq_len,
            "records": self.accounts.as_dict(),
            "samples": self.samples,
            "samples_skipped": dict(sorted(self.samples_skipped.items())),
            "tokens": self.tokens,
            "fill_ratio": round(self.tokens / all_capacity, 4) if all_capacity else 0.0,
            "splits": splits,
            "seconds": round(seconds, 3),
            "tokens_per_sec": round(self.tokens / seconds) if seconds > 0 else None,
        }


def payload_chars(payload) -> int:
    """Characters a record puts through the tokenizer (a document, a conversation's contents, a pair's)."""
    if isinstance(payload, str):
        return len(payload)
    if hasattr(payload, "chars"):  # a PreferencePair
        return payload.chars()
    return sum(len(turn["content"]) for turn in payload)


def is_prepared_dir(path: Path) -> bool:
    """Whether `path` is an earlier output of prepare (what --force may replace)."""
    try:
        manifest = read_manifest(path)
    except (DataError, OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("created_by") == "dataset.prepare"


def make_packers(phase, seq_len: int, pad_id: int) -> dict:
    if phase == PREFERENCE:
        return {}  # a pair is a block of its own (take_pair)
    if phase == 1:
        return {split: StreamPacker(seq_len, pad_id) for split in ("train", "eval")}
    return {split: BestFitPacker(seq_len, pad_id) for split in ("train", "eval")}


def format_issues(issues: list[RecordIssue], max_errors: int) -> str:
    lines = [str(issue) for issue in issues]
    if len(issues) >= max_errors:
        lines.append(f"(stopped after {max_errors} problems)")
    lines.append("Fix the input, or pass --skip-invalid to skip such records (they are counted in stats.json).")
    return "\n".join(lines)


class Progress:
    """A tqdm bar over input bytes with tokens/s; silent with --quiet."""

    def __init__(self, options: PrepareOptions) -> None:
        self.bar = None
        if options.quiet:
            return
        from tqdm import tqdm

        total = sum(os.path.getsize(p) for p in options.inputs if os.path.isfile(p)) if options.format != "hf" else None
        self.bar = tqdm(total=total or None, unit="B", unit_scale=True, desc="prepare", file=sys.stderr)

    def update(self, run: Preparation, started: float) -> None:
        if self.bar is None:
            return
        current = run.current_source.bytes_read if run.current_source is not None else 0
        self.bar.n = max(self.bar.n, run.bytes_done + current)
        elapsed = max(time.perf_counter() - started, 1e-9)
        self.bar.set_postfix(tokens=run.tokens, tok_s=f"{run.tokens / elapsed:,.0f}", refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# -- command line ------------------------------------------------------------------------------
def prepare(options: PrepareOptions) -> dict:
    """Prepare `options.inputs` into `options.out` (the command's work, for code that calls it);
    returns the stats it wrote to stats.json. Bad input raises DataError, OutputConflict,
    TokenizerError or HubModelError, each naming the file, the record or the option."""
    return Preparation(options).run()


def masking(value: str) -> int:
    """--phase: 1 or 2, the masking (a curriculum's phase 3 trains on data prepared with either)."""
    if value not in ("1", "2"):
        raise argparse.ArgumentTypeError(
            f"{value!r}: --phase is the masking, not the curriculum's phase: 1 trains every token (raw text), 2 the "
            "answers only (chat, alpaca); a run's phase 3 (or any) takes data prepared with either")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tpu-lora prepare",
        description="Validate, tokenize, mask and pack a dataset into fixed-shape int32 shards "
        "(train/ and eval/) with manifest.json and stats.json. Run once, on CPU, before training.",
        epilog="Exit status: 0 on success, 2 on bad input or options (the message names the file and line), "
        "3 when the output could not be written (a full or read-only disk; nothing is left behind).",
    )
    parser.add_argument("--config", help="YAML file with any of the options below (flags override it)")
    parser.add_argument("--format", choices=FORMATS, help="input format (default: auto, detected per file)")
    parser.add_argument("--input", dest="inputs", action="append", help="input file; repeat for several")
    parser.add_argument("--tokenizer", help="tokenizer directory (usually the base model's)")
    parser.add_argument("--seq-len", dest="seq_len", type=int, help="tokens per packed block")
    parser.add_argument("--out", help="output directory")
    parser.add_argument("--phase", type=masking, metavar="{1,2}",
                        help="what the loss trains, not the curriculum's phase: 1 every token (raw text, continued "
                        "pretraining), 2 the answers only (chat, alpaca); any phase of a run takes either")
    parser.add_argument("--eval-fraction", dest="eval_fraction", type=float, help="held-out share (default 0.05)")
    parser.add_argument("--skip-invalid", dest="skip_invalid", action="store_true", default=None,
                        help="skip and count bad records instead of stopping")
    parser.add_argument("--seed", type=int, help="seed of the train/eval split (default 0)")
    parser.add_argument("--overlong", choices=OVERLONG_POLICIES, help="phase 2 samples over seq_len (default truncate)")
    parser.add_argument("--max-prompt-len", dest="max_prompt_len", type=int,
                        help="preference pairs: a prompt keeps its last N tokens (default seq_len / 2), then each "
                        "row its first seq_len")
    parser.add_argument("--column", dest="columns", action="append", metavar="OURS=THEIRS",
                        help="map an input column to ours, e.g. --column text=content")
    parser.add_argument("--split", help="split of an hf dataset (default train)")
    parser.add_argument("--hf-name", dest="hf_name", help="config name of an hf hub dataset")
    parser.add_argument(
        "--max-errors", dest="max_errors", type=int, help="problems reported before stopping (default 10)"
    )
    parser.add_argument("--batch-size", dest="batch_size", type=int, help="records per tokenizer batch (default 1024)")
    parser.add_argument("--max-record-chars", dest="max_record_chars", type=int,
                        help="longest record accepted, in characters (default 4,000,000; memory ~100 bytes each)")
    parser.add_argument("--new-tokens", dest="new_tokens", nargs="+", metavar="TOKEN",
                        help="tokens added to the tokenizer first, after its vocabulary (the run's model.new_tokens, "
                        "in the same order)")
    parser.add_argument("--force", action="store_true", default=None, help="replace an existing --out")
    parser.add_argument("--quiet", action="store_true", default=None, help="no progress bar")
    return parser


def options_from_args(argv: list[str] | None) -> PrepareOptions:
    args = build_parser().parse_args(argv)
    values: dict = {}
    if args.config:
        values.update(read_yaml_options(args.config))
    for key, value in vars(args).items():
        if key == "config" or value is None:
            continue
        if key == "columns":
            value = parse_columns(value)
        values[key] = value
    return PrepareOptions(**values)


def read_yaml_options(path: str) -> dict:
    data = read_yaml_mapping(path, DataError, "a mapping of option names to values") or {}
    known = {f.name for f in fields(PrepareOptions)}
    if "input" in data and "inputs" not in data:
        data["inputs"] = data.pop("input")
    unknown = sorted(set(data) - known)
    if unknown:
        raise DataError(f"{path}: unknown key(s) {unknown}; known keys: {sorted(known)}")
    return data


def parse_columns(pairs: list[str]) -> dict[str, str]:
    columns = {}
    for pair in pairs:
        ours, sep, theirs = pair.partition("=")
        if not sep or not ours or not theirs:
            raise DataError(f"--column {pair!r}: expected OURS=THEIRS, e.g. text=content")
        columns[ours] = theirs
    return columns


def summary(stats: dict, out: str) -> str:
    records = stats["records"]
    skipped = ", ".join(f"{k}: {v}" for k, v in records["skipped_by_reason"].items()) or "none"
    splits = stats["splits"]
    return (
        f"wrote {out}: phase {stats['phase']}, seq_len {stats['seq_len']}\n"
        f"  records: {records['read']} read, {records['kept']} kept, {records['skipped']} skipped ({skipped}), "
        f"{records['truncated']} truncated\n"
        + (f"  samples: {stats['samples']} (one per answer where the chat template renders earlier turns "
           f"differently), skipped: {stats['samples_skipped'] or 'none'}\n"
           if stats["samples"] != records["kept"] or stats["samples_skipped"] else "")
        + f"  {'pairs' if stats['phase'] == PREFERENCE else 'blocks'}: {splits['train']['blocks']} train, "
        f"{splits['eval']['blocks']} eval; "
        f"{stats['tokens']:,} tokens, fill ratio {stats['fill_ratio']:.3f}, "
        + (f"{stats['tokens_per_sec']:,} tokens/s" if stats["tokens_per_sec"] is not None
           else "tokens/s n/a (too fast to time)")
    )


def main(argv: list[str] | None = None) -> int:
    try:
        with stop_signals_unwind():  # SIGTERM unwinds as SIGINT does: what was staged is removed
            options = options_from_args(argv)
            stats = prepare(options)
    except (DataError, OutputConflict, TokenizerError, HubModelError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # SIGINT, or SIGTERM (utils/interrupts.py): what was staged is removed
        return report_interrupted(err, "prepare")
    except OSError as err:  # a full or read-only disk: the partial output is already removed
        where = f"{err.filename}: " if err.filename else ""
        print(f"error: {where}{err.strerror or err}; nothing was written to {options.out} (the partial output was "
              "removed). Free space or fix permissions, then run the same command again", file=sys.stderr)
        return 3
    print(summary(stats, options.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
