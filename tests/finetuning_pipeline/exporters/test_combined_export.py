"""`python -m finetuning_pipeline.export --combine`: the combined adapter PEFT loads, the merged
model PEFT would make, and the combinations refused with one line (exit 2)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
import torch
from adapter_helpers import DTYPE, peft_combined, write_random_adapters
from conftest import random_tokens, tiny_causal_lm
from tolerances import assert_equal_in_exact_arithmetic

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return write_random_adapters(tmp_path_factory.mktemp("adapters"))


def run_export(*args):
    from finetuning_pipeline import export

    return export.main(list(map(str, args)))


def base_with_tokenizer(tmp_path):
    """The adapters' tiny Llama in float64 (as they are: equal in exact arithmetic), with a
    tokenizer for a merged model's directory."""
    from finetuning_pipeline.demo.tiny_model import write_tiny_model

    base = tmp_path / "base"
    tiny_causal_lm("llama").to(DTYPE).save_pretrained(base)
    write_tiny_model(tmp_path / "tokenizer_source")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tmp_path / "tokenizer_source" / name).exists():
            (base / name).write_bytes((tmp_path / "tokenizer_source" / name).read_bytes())
    return base


def test_the_export_writes_a_combined_adapter_peft_loads_and_a_merged_model(adapters, tmp_path, capsys):
    """--adapter-only: one PEFT adapter whose logits are PEFT's combined adapter's. Merged: the base
    with that adapter merged, as PEFT's merge_and_unload of it."""
    from transformers import AutoModelForCausalLM

    from utils.precision import float64_throughout

    base = base_with_tokenizer(tmp_path)
    flags = ["--base", base, "--adapter", adapters / "a1", "--adapter", adapters / "a2", "--weights", "0.7,0.3"]
    assert run_export(*flags, "--combine", "ties", "--density", "0.5", "--adapter-only", "--out", tmp_path / "c") == 0
    _, _, theirs = peft_combined(adapters, ["a1", "a2"], [0.7, 0.3], "ties", density=0.5)
    theirs.set_adapter("c")
    loaded = peft.PeftModel.from_pretrained(tiny_causal_lm("llama").to(DTYPE), tmp_path / "c").eval()
    tokens = random_tokens()
    with torch.no_grad(), float64_throughout(DTYPE):
        assert_equal_in_exact_arithmetic(loaded(tokens).logits, theirs.eval()(tokens).logits, "combined adapter logits")

    assert run_export(*flags, "--combine", "cat", "--out", tmp_path / "merged") == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    _, _, reference = peft_combined(adapters, ["a1", "a2"], [0.7, 0.3], "cat")
    reference.set_adapter("c")
    expected = reference.merge_and_unload(adapter_names=["c"]).state_dict()
    for key, value in merged.state_dict().items():
        assert value.dtype == DTYPE, key
        assert_equal_in_exact_arithmetic(value, expected[key], f"merged {key}")

    config = json.loads((adapters / "a2" / "adapter_config.json").read_text())
    (tmp_path / "other").mkdir()
    for name in ("adapter_model.safetensors",):
        (tmp_path / "other" / name).write_bytes((adapters / "a2" / name).read_bytes())
    (tmp_path / "other" / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "x"}))
    capsys.readouterr()
    assert run_export("--base", base, "--adapter", adapters / "a1", "--adapter", tmp_path / "other", "--combine",
                      "linear", "--out", tmp_path / "bad") == 2
    assert "adapters of different bases do not combine" in capsys.readouterr().err
    # One base written as a relative and as an absolute path is one base.
    for name, written_as in (("absolute", str(base.resolve())), ("relative", os.path.relpath(base))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_model.safetensors").write_bytes((adapters / "a2" / "adapter_model.safetensors")
                                                                    .read_bytes())
        (tmp_path / name / "adapter_config.json").write_text(
            json.dumps({**config, "base_model_name_or_path": written_as}))
    assert run_export("--base", base, "--adapter", tmp_path / "absolute", "--adapter", tmp_path / "relative",
                      "--combine", "linear", "--adapter-only", "--out", tmp_path / "same_base") == 0, \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_export(*flags, "--out", tmp_path / "stacked")  # --weights without --combine
    assert "--weights go with --combine" in capsys.readouterr().err


def test_adapters_are_matched_to_a_base_by_their_lineage_not_by_its_path(adapters, tmp_path, capsys):
    """Two adapters whose lineage.json records the same base weights combine, whatever
    path each adapter_config.json names (the base moved between the runs); other weights are
    refused, whatever the paths. An adapter without lineage.json is matched by the name it records,
    against any adapter's name."""
    from finetuning_pipeline.model.lineage import write_lineage

    base = tmp_path / "base"
    tiny_causal_lm("llama").to(DTYPE).save_pretrained(base)

    def adapter(name, source, base_named, fingerprint):
        directory = tmp_path / name
        directory.mkdir()
        weights = "adapter_model.safetensors"
        (directory / weights).write_bytes((adapters / source / weights).read_bytes())
        config = json.loads((adapters / source / "adapter_config.json").read_text())
        (directory / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base_named}))
        if fingerprint:
            write_lineage(directory, {"base": {"name": base_named, "revision": None, "fingerprint": fingerprint},
                                      "merged_adapters": []})
        return directory

    moved = [adapter("before_move", "a1", "/runs/old/base", "sha256:same"),
             adapter("after_move", "a2", "/data/new/base", "sha256:same")]
    assert run_export("--base", base, *[f for a in moved for f in ("--adapter", a)], "--combine", "linear",
                      "--adapter-only", "--out", tmp_path / "moved") == 0, capsys.readouterr().err

    other = adapter("other_weights", "a2", "/runs/old/base", "sha256:other")
    capsys.readouterr()
    assert run_export("--base", base, "--adapter", moved[0], "--adapter", other, "--combine", "linear",
                      "--adapter-only", "--out", tmp_path / "refused") == 2
    assert "adapters trained on different weights do not combine" in capsys.readouterr().err

    unrecorded = adapter("peft_made", "a2", "/data/new/base", None)  # the name of the second recorded one
    assert run_export("--base", base, "--adapter", moved[0], "--adapter", moved[1], "--adapter", unrecorded,
                      "--combine", "linear", "--adapter-only", "--out", tmp_path / "mixed") == 0, \
        capsys.readouterr().err
    stranger = adapter("stranger", "a2", "/elsewhere/base", None)
    assert run_export("--base", base, "--adapter", moved[0], "--adapter", stranger, "--combine", "linear",
                      "--adapter-only", "--out", tmp_path / "refused2") == 2
    assert "adapters of different bases do not combine" in capsys.readouterr().err


def test_notes_on_a_combination_name_the_users_adapters_not_a_temporary_directory(adapters, tmp_path, capsys):
    """The combined adapter reaches the writers as a temporary directory; the notes on adapters
    trained on a quantized base name the --adapter paths the user gave, not that directory
    (combined-adapter-... in the system's temporary folder)."""
    from finetuning_pipeline.model.lineage import model_lineage, quantized_with, write_lineage

    base = base_with_tokenizer(tmp_path)
    given = []
    for name in ("a1", "a2"):
        shutil.copytree(adapters / name, tmp_path / name)
        write_lineage(tmp_path / name, quantized_with(model_lineage(base), "q4_0", "float64"))
        given += ["--adapter", tmp_path / name]
    capsys.readouterr()
    for fmt, out in (([], "merged"), (["--format", "gguf", "--adapter-only"], "combined.gguf")):
        assert run_export(*fmt, "--base", base, *given, "--combine", "linear", "--out", tmp_path / out) == 0
        err = capsys.readouterr().err
        assert f"adapter {tmp_path / 'a1'} + {tmp_path / 'a2'} (combined) was trained on the base stored as q4_0" \
               in err, err
        assert "combined-adapter-" not in err and tempfile.gettempdir() + "/" not in err.replace(str(tmp_path), "")
