"""Nothing is lost: no command writes into its own inputs, refuses an existing output without
--force, and even with --force replaces only what it wrote itself (utils/output_guard.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from trainer_helpers import SEQ_LEN, write_run_config

from dataset import prepare
from dataset.samples import DOMAIN_TEXT
from dataset.scripts import download_text_dataset
from finetuning_pipeline import main
from finetuning_pipeline.demo import tiny_model
from finetuning_pipeline.export import main as export_main
from lora_logic.adapter_io import save_adapters
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora


def tree_digest(path: Path) -> dict[str, str]:
    """Every file under `path` (or the file itself) with its sha256: what must not change."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {
        str(f.relative_to(path) if f != path else f.name): hashlib.sha256(f.read_bytes()).hexdigest() for f in files
    }


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    inject_lora(model, LoraConfig(r=4, alpha=8))
    path = tmp_path_factory.mktemp("run") / "phase1" / "adapter"
    save_adapters(model, path, LoraConfig(r=4, alpha=8), str(tiny_model_dir))
    return path


@pytest.fixture
def base_copy(tiny_model_dir, tmp_path) -> Path:
    copy = tmp_path / "base"
    shutil.copytree(tiny_model_dir, copy)
    return copy


@pytest.mark.parametrize("where", ["the base", "inside the base", "the adapter", "the run's phase dir",
                                   "the tokenizer"])
def test_export_never_writes_into_its_inputs_even_with_force(where, base_copy, adapter, tmp_path, capsys):
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(base_copy, tokenizer)
    out = {"the base": base_copy, "inside the base": base_copy / "merged", "the adapter": adapter,
           "the run's phase dir": adapter.parent, "the tokenizer": tokenizer}[where]
    guarded = [base_copy, adapter, tokenizer]
    before = [tree_digest(p) for p in guarded]
    args = ["--base", str(base_copy), "--adapter", str(adapter), "--tokenizer", str(tokenizer), "--out", str(out),
            "--force"]
    assert export_main(args) == 2
    err = capsys.readouterr().err
    assert f"error: --out {out} overlaps" in err and "never writes into its own inputs" in err
    assert [tree_digest(p) for p in guarded] == before


def test_export_with_force_replaces_only_an_earlier_export(base_copy, adapter, tmp_path, capsys):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "mine.txt").write_text("not the exporter's\n")
    args = ["--base", str(base_copy), "--adapter", str(adapter), "--out", str(out)]
    assert export_main(args) == 2
    assert f"--out {out} already exists; pass --force" in capsys.readouterr().err
    assert export_main([*args, "--force"]) == 2
    assert "holds files that finetuning_pipeline.export did not write" in capsys.readouterr().err
    assert (out / "mine.txt").read_text() == "not the exporter's\n"
    (out / "mine.txt").unlink()  # an empty directory holds nothing to lose
    assert export_main(args) == 0
    assert (out / "config.json").is_file()
    first = tree_digest(out)
    assert export_main([*args, "--force"]) == 0  # its own earlier output: replaced
    assert tree_digest(out) == first  # the same merge, byte for byte


@pytest.mark.parametrize("where", ["the tokenizer", "the input's directory", "the input file"])
def test_prepare_never_writes_into_its_inputs(where, base_copy, tmp_path, capsys):
    source = tmp_path / "corpus" / "text.jsonl"
    source.parent.mkdir()
    shutil.copy(DOMAIN_TEXT, source)
    out = {"the tokenizer": base_copy, "the input's directory": source.parent, "the input file": source}[where]
    before = [tree_digest(base_copy), tree_digest(source)]
    args = ["--input", str(source), "--tokenizer", str(base_copy), "--seq-len", str(SEQ_LEN), "--out", str(out),
            "--quiet", "--force"]
    assert prepare.main(args) == 2
    assert f"error: --out {out} overlaps" in capsys.readouterr().err
    assert [tree_digest(base_copy), tree_digest(source)] == before


def test_prepare_with_force_replaces_only_prepared_data(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    args = ["--input", str(DOMAIN_TEXT), "--tokenizer", str(tiny_model_dir), "--seq-len", str(SEQ_LEN),
            "--out", str(out), "--quiet", "--force"]
    assert prepare.main(args) == 2
    assert "holds files that dataset.prepare did not write" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine\n"
    (out / "notes.txt").unlink()
    assert prepare.main(args) == 0
    assert prepare.main(args) == 0  # its own output: replaced


def test_tiny_model_and_download_scripts_refuse_what_they_did_not_write(tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    (out / "weights.bin").write_text("someone's model\n")
    assert tiny_model.main(["--out", str(out)]) == 2
    assert f"--out {out} already exists; pass --force" in capsys.readouterr().err
    assert tiny_model.main(["--out", str(out), "--force"]) == 2
    assert "finetuning_pipeline.demo.tiny_model did not write" in capsys.readouterr().err
    assert (out / "weights.bin").read_text() == "someone's model\n"

    source = tmp_path / "wiki.jsonl"
    source.write_text(json.dumps({"title": "Cluj", "text": "Cluj-Napoca este un municipiu. " * 20}) + "\n")
    target = tmp_path / "mine.jsonl"
    target.write_text("my own data\n")
    assert download_text_dataset.main(["--dataset", str(source), "--out", str(target)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert target.read_text() == "my own data\n"
    assert download_text_dataset.main(["--dataset", str(source), "--out", str(source), "--force"]) == 2
    assert "overlaps --dataset" in capsys.readouterr().err


def run_main(config: Path, capsys, *extra) -> tuple[int, str]:
    code = main.main(["--config", str(config), *extra])
    return code, capsys.readouterr().err


def test_the_run_never_writes_into_its_inputs(tiny_model_dir, data, base_copy, tmp_path, capsys):
    inside_model = write_run_config(tmp_path / "a.yaml", base_copy, data, base_copy / "runs")
    code, err = run_main(inside_model, capsys)
    assert code == 2 and f"output_dir: {base_copy / 'runs'} is model.path ({base_copy}) or lies inside it" in err
    # The data of phase 1 at X/phase1 with output_dir X: the run would write its phase1/ over it.
    staged = tmp_path / "staged"
    shutil.copytree(data[1], staged / "phase1")
    over_data = write_run_config(tmp_path / "b.yaml", tiny_model_dir, {1: staged / "phase1", 2: data[2]}, staged)
    code, err = run_main(over_data, capsys)
    assert code == 2 and f"the run writes {staged.resolve() / 'phase1'}, which overlaps phase1.data" in err
    assert not (base_copy / "runs").exists() and tree_digest(staged / "phase1") == tree_digest(data[1])


def test_resume_never_force_replaces_only_a_runs_own_phase_dir(tiny_model_dir, data, tmp_path, capsys):
    output_dir = tmp_path / "out"
    (output_dir / "phase1").mkdir(parents=True)
    (output_dir / "phase1" / "paper.tex").write_text("my thesis\n")
    config = write_run_config(tmp_path / "r.yaml", tiny_model_dir, data, output_dir)
    code, err = run_main(config, capsys, "--phase", "1", "--resume", "never", "--force")
    assert code == 2 and "holds paper.tex, which no run wrote" in err
    assert (output_dir / "phase1" / "paper.tex").read_text() == "my thesis\n"
