"""Every writer stopped mid-write by SIGTERM or SIGINT: the output never appears,
nothing it staged stays behind, and the command says so in one line and exits 128 + the signal's
number, with no traceback. The signal is sent by the process to itself from inside the write (a
patched writer call), so it lands mid-write every time, in the command's own process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO

from dataset.samples import DOMAIN_TEXT

# argv[1]: "module.attribute" to patch; the patched call signals the process, then does its work.
# The command runs as `python -m` runs it (as __main__), or, with as_main off, as its main() called
# from here (for a patch in the command's own module, which __main__ would not see).
# (SIGINT's handler is taken back first: a test run started in the background inherits SIGINT
# ignored, as every background job does, and the command would rightly keep ignoring it.)
SIGNAL_MID_WRITE = """
import importlib, os, runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
where, sig, as_main, command, *argv = sys.argv[1:]
module_name, _, name = where.rpartition(".")
module = importlib.import_module(module_name)
real = getattr(module, name)
def signalling(*args, **kwargs):
    os.kill(os.getpid(), getattr(signal, sig))
    return real(*args, **kwargs)
setattr(module, name, signalling)
if as_main == "yes":
    sys.argv = [command, *argv]
    runpy.run_module(command, run_name="__main__", alter_sys=True)
sys.exit(importlib.import_module(command).main(argv))
"""


def run_signalled(where: str, sig: str, command: str, *argv, as_main: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SIGNAL_MID_WRITE, where, sig, "yes" if as_main else "no", command,
                           *map(str, argv)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PJRT_DEVICE": "CPU"})


def assert_stopped_cleanly(done: subprocess.CompletedProcess, sig: str, command: str, folder, out) -> None:
    assert done.returncode == {"SIGTERM": 143, "SIGINT": 130}[sig], done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"error: {command}: stopped by {sig}; nothing half-written was left" in done.stderr, done.stderr
    assert not out.exists()
    assert [p.name for p in folder.rglob("*") if ".partial" in p.name] == []


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_export_gguf_stopped_mid_write(tiny_model_dir, tmp_path, sig):
    out = tmp_path / "model.gguf"
    done = run_signalled("finetuning_pipeline.exporters.gguf_export.encode", sig, "finetuning_pipeline.export",
                         "--format", "gguf", "--outtype", "q8_0", "--base", tiny_model_dir, "--out", out)
    assert_stopped_cleanly(done, sig, "export", tmp_path, out)


def test_a_command_stopped_before_it_writes_says_so_in_one_line_too(tiny_model_dir, tmp_path):
    """SIGTERM while the export still reads its base (nothing staged yet): one line, exit 143, no
    traceback, as SIGINT (the trainer keeps its own handlers: SIGTERM checkpoints and stops it)."""
    out = tmp_path / "model.gguf"
    done = run_signalled("finetuning_pipeline.exporters.gguf_export.read_config", "SIGTERM",
                         "finetuning_pipeline.export", "--format", "gguf", "--base", tiny_model_dir, "--out", out)
    assert_stopped_cleanly(done, "SIGTERM", "export", tmp_path, out)


def write_adapter(tiny_model_dir, directory):
    from transformers import AutoModelForCausalLM

    from lora_logic import LoraConfig, inject_lora, save_adapters

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    inject_lora(model, LoraConfig(r=4, alpha=8))
    save_adapters(model, directory, LoraConfig(r=4, alpha=8), str(tiny_model_dir))


def test_export_hf_stopped_mid_write(tiny_model_dir, tmp_path):
    write_adapter(tiny_model_dir, tmp_path / "adapter")
    out = tmp_path / "merged"
    # Called once the weights and tokenizer are in the staging directory, before it is put in place.
    done = run_signalled("finetuning_pipeline.exporters.merged.write_lineage", "SIGTERM", "finetuning_pipeline.export",
                         "--base", tiny_model_dir, "--adapter", tmp_path / "adapter", "--out", out)
    assert_stopped_cleanly(done, "SIGTERM", "export", tmp_path, out)


def test_prepare_stopped_mid_write(tiny_model_dir, tmp_path):
    out = tmp_path / "data"
    done = run_signalled("utils.atomic_io.atomic_write_json", "SIGTERM", "dataset.prepare", "--tokenizer",
                         tiny_model_dir, "--seq-len", 64, "--input", DOMAIN_TEXT, "--out", out, "--quiet")
    assert_stopped_cleanly(done, "SIGTERM", "prepare", tmp_path, out)


def test_a_download_script_stopped_mid_write(tmp_path):
    """The download scripts' JSONL (dataset/scripts/export_jsonl.py) is staged as every output is."""
    source = tmp_path / "articles.jsonl"
    source.write_text("".join(f'{{"id": "{k}", "url": "u", "title": "T{k}", "text": "{"x" * 300}"}}\n'
                              for k in range(5)))
    out = tmp_path / "out" / "wiki.jsonl"
    done = run_signalled("dataset.scripts.download_text_dataset.wikipedia_to_record", "SIGTERM",
                         "dataset.scripts.download_text_dataset", "--dataset", source, "--out", out, as_main=False)
    assert_stopped_cleanly(done, "SIGTERM", "the download script", tmp_path, out)
    assert not out.parent.exists()  # made for the output, and taken back with it


def test_a_combined_gguf_export_stopped_mid_write_leaves_no_temporary_adapter(tiny_model_dir, tmp_path):
    """The hard case: two stagings nested, the combined adapter in the system's temporary folder
    (TMPDIR here) and the GGUF beside --out; a SIGTERM mid-write removes both."""
    for name in ("a1", "a2"):
        write_adapter(tiny_model_dir, tmp_path / name)
    (tmp_path / "tmp").mkdir()
    out = tmp_path / "combined.gguf"
    done = subprocess.run(
        [sys.executable, "-c", SIGNAL_MID_WRITE, "finetuning_pipeline.exporters.gguf_export.encode", "SIGTERM", "yes",
         "finetuning_pipeline.export", "--format", "gguf", "--base", str(tiny_model_dir), "--adapter",
         str(tmp_path / "a1"), "--adapter", str(tmp_path / "a2"), "--combine", "linear", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PJRT_DEVICE": "CPU", "TMPDIR": str(tmp_path / "tmp")})
    assert_stopped_cleanly(done, "SIGTERM", "export", tmp_path, out)
    assert list((tmp_path / "tmp").iterdir()) == []  # no combined-adapter-* left
