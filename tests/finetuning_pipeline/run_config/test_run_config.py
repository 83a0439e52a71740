"""Config loading and the checks main.py makes before touching a device: each error names its key."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import REPO
from trainer_helpers import write_run_config

from finetuning_pipeline import main
from finetuning_pipeline.run_config import ConfigError, load_config

DEMO = "finetuning_pipeline/configs/demo.yaml"


def test_demo_config_loads_and_overrides_apply():
    config = load_config(DEMO, ["train.max_steps=7", "train.lr=3e-4", "lora.target_modules=[q_proj,v_proj]",
                                "model.activation_checkpointing=true", "output_dir=elsewhere"])
    assert (config.train.max_steps, config.train.lr) == (7, 3e-4)
    assert config.lora.target_modules == ["q_proj", "v_proj"]
    assert config.model.activation_checkpointing is True
    assert config.output_dir == "elsewhere"
    assert config.phase(1).data == "outputs/demo/data/phase1"  # data paths do not follow output_dir


def test_a_choice_is_its_word_in_any_case_and_0_or_1_where_false_and_true_are_choices():
    """activation_checkpointing took YAML's yes, on and 1 but refused FULL; each now reads as the
    choice it names, written back as that choice."""
    config = load_config(DEMO, ["model.activation_checkpointing=FULL", "model.dtype=Float32",
                                "runtime.backend=Native", "runtime.compile=EAGER"])
    assert (config.model.activation_checkpointing, config.model.dtype) == ("full", "float32")
    assert (config.runtime.backend, config.runtime.compile) == ("native", "eager")
    for written, read in (("1", True), ("0", False), ("on", True), ("Selective", "selective")):
        checkpointing = load_config(DEMO, [f"model.activation_checkpointing={written}"]).model.activation_checkpointing
        assert checkpointing is read if isinstance(read, bool) else checkpointing == read, written
    with pytest.raises(ConfigError, match="train.micro_batch: expected int, got True"):
        load_config(DEMO, ["train.micro_batch=yes"])  # a number is not a choice: unchanged


def test_overrides_go_before_and_after_the_flags():
    """`--config c.yaml output_dir=X --phase 1 train.max_steps=1`: every key=value is an override,
    before and after the flags (not argparse's "unrecognized arguments: train.max_steps=1")."""
    args = main.parse_args(["--config", DEMO, "output_dir=X", "--phase", "1", "train.max_steps=1", "--resume",
                            "never", "lora.r=4"])
    assert (args.config, args.phase, args.resume) == (DEMO, "1", "never")
    assert args.overrides == ["output_dir=X", "train.max_steps=1", "lora.r=4"]


@pytest.mark.parametrize("overrides, source", [
    (["model.quantize=q9_0"], "override model.quantize=q9_0: model.quantize must be none, q8_0"),
    (["train.max_steps=5", "train.lr=-1"], "override train.lr=-1: train.lr must be > 0"),
    (["lora.r=0"], "override lora.r=0: lora.r must be a positive integer"),
    (["phase1.lr=-2"], "override phase1.lr=-2: phase1.lr must be > 0"),
    (["train.lr=-1", "train.lr=-3"], "override train.lr=-3: train.lr must be > 0, got -3.0"),  # the one that won
])
def test_an_error_in_an_override_names_the_override_not_the_file(overrides, source):
    """The error names the override that set the value, not the YAML file (whose value was valid)."""
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, overrides)
    assert str(err.value).startswith(source), str(err.value)


def test_phase_one_refuses_to_merge_an_earlier_phase_it_does_not_have(tmp_path):
    """phase1.init=merge is refused, not ignored (phase 1 has no earlier phase)."""
    with pytest.raises(ConfigError, match=r"^override phase1.init=merge: phase1.init=merge: phase 1 has no earlier "
                                          "phase to build on"):
        load_config(DEMO, ["phase1.init=merge"])
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  path: somewhere\nphase1:\n  data: d1\n  init: merge\n")
    with pytest.raises(ConfigError, match=rf"^{path}: phase1.init=merge: phase 1 has no earlier phase"):
        load_config(path)
    assert load_config(DEMO, ["phase1.init=fresh"]).phase(1).init == "fresh"  # what phase 1 does: said, not refused


def test_an_error_in_the_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  path: somewhere\ntrain:\n  lr: -1\n")
    with pytest.raises(ConfigError, match=rf"^{path}: train.lr must be > 0"):
        load_config(path, ["train.max_steps=3"])  # an override of another key is not blamed


LEAF = """
import sys
from finetuning_pipeline.run_config import load_config
config = load_config("finetuning_pipeline/configs/mistral7b_v6e8.yaml", ["train.lr=1e-4"])
heavy = sorted(m for m in ("torch", "torch_xla", "transformers", "numpy") if m in sys.modules)
print(config.train.lr, heavy)
"""


def test_reading_a_config_imports_no_runtime_module():
    """The run config is a leaf: loading and checking a YAML (preflight on a laptop, a CI lint of
    configs) imports neither torch, torch_xla nor transformers."""
    done = subprocess.run([sys.executable, "-c", LEAF], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0.0001", "[]"]


def test_the_old_name_of_activation_checkpointing_still_works_and_says_the_new_one(tmp_path, capsys):
    """model.gradient_checkpointing was renamed model.activation_checkpointing (one word for
    recomputing activations): configs written with the old key, in YAML or as an override, load."""
    old = tmp_path / "old.yaml"
    old.write_text("model: {path: m, gradient_checkpointing: true}\nphase1: {data: d}\n")
    assert load_config(old).model.activation_checkpointing is True
    assert load_config(DEMO, ["model.gradient_checkpointing=true"]).model.activation_checkpointing is True
    notes = capsys.readouterr().err
    assert notes.count("model.gradient_checkpointing is now called model.activation_checkpointing") == 2


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_stepz=3", "unknown key 'max_stepz' under train"),
        ("trian.max_steps=3", "unknown key 'trian' under the top level"),
        ("lora.r=0", "lora.r must be a positive integer"),
        ("train.grad_accum=0", "train.grad_accum must be >= 1"),
        ("train.lr=fast", "train.lr: expected float, got 'fast'"),
        ("train.micro_batch=2.5", "train.micro_batch: expected int"),
        ("train.min_lr_ratio=0", "train.min_lr_ratio must be in (0, 1]"),
        ("model.dtype=fp8", "model.dtype must be bfloat16, float32, float16 or float64, got 'fp8'"),
        ("parallel.mode=zero3", "parallel.mode must be dp or fsdp, got 'zero3'"),
        ("tpu.assumed_mfu=1.5", "tpu.assumed_mfu must be in (0, 1]"),
        ("phase2.init=restart", "phase2.init must be continue, merge or fresh, got 'restart'"),
        ("train.max_steps", "expected key=value"),
        ("train.max_wall_time=8x", "train.max_wall_time: '8x' is not a duration"),
        ("train.loss_chunk_tokens=-1", "train.loss_chunk_tokens must be >= 0"),
        ("model.attention=sdpa", "model.attention must be auto, dense, splash or flash"),
        # YAML reads off as false: said, with the words to write
        ("runtime.compile=off", "runtime.compile must be auto, layers or eager, got False (YAML reads on/off, "
         "yes/no and true/false as booleans: write one of the words above)"),
        ("parallel.mesh.data=0", "parallel.mesh.data must be a chip count >= 1"),
        ("parallel.mesh.data=-1", "at most one of data and fsdp may be -1"),
        # Values outside their domain once trained a worse model with exit 0: a NaN passes every
        # `<` check (a NaN clip norm switched clipping off), so every float is checked finite first.
        ("train.eps=-1e-8", "train.eps must be > 0"),
        ("train.eps=0", "train.eps must be > 0"),
        ("train.max_grad_norm=.nan", "train.max_grad_norm must be a finite number, got nan"),
        ("train.lr=.inf", "train.lr must be a finite number, got inf"),
        ("train.lr=inf", "train.lr must be a finite number, got inf"),
        ("train.lr=-1e-3", "train.lr must be > 0"),
        ("train.weight_decay=nan", "train.weight_decay must be a finite number"),
        ("train.weight_decay=-0.1", "train.weight_decay must be >= 0"),
        ("train.betas=[0.9,.nan]", "train.betas[1] must be a finite number"),
        ("train.min_lr_ratio=.nan", "train.min_lr_ratio must be a finite number"),
        ("lora.alpha=.inf", "lora.alpha must be a finite number"),
        ("lora.alpha=-16", "lora.alpha must be a positive number"),
        ("lora.dropout=1.0", "lora.dropout must be in [0, 1)"),
        ("phase2.lr=.nan", "phase2.lr must be a finite number"),
        ("tpu.assumed_mfu=.nan", "tpu.assumed_mfu must be a finite number"),
        ("parallel.host_timeout_s=.inf", "parallel.host_timeout_s must be a finite number"),
        ("eval.micro_batch=0", "eval.micro_batch must be >= 1"),
        ("train.seed=-1", "train.seed must be >= 0 and < 4294967293"),  # (2**32 less the demo's 3 phases)
        ("train.warmup_compiles_steps=-1", "train.warmup_compiles_steps must be >= 0"),
        ("eval.max_batches=-1", "eval.max_batches must be >= 0"),
        ("output_dir=", "output_dir: empty"),
        ("model.path=", "model.path: not set"),
    ],
)
def test_bad_values_name_their_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_config(DEMO, [override])


@pytest.mark.parametrize("content, overrides, message", [
    (b"\xff\xfe model: {}", [], "not UTF-8 text (byte 0)"),
    (b"- model\n- train\n", ["train.lr=1e-3"], "expected a mapping of sections (model:, train:, ...), got a list"),
    (b"just a sentence\n", ["train.lr=1e-3"], "expected a mapping of sections (model:, train:, ...), got a str"),
    (b"", [], "the config is empty"),
    (b"# only a comment\n", ["model.path=x"], "the config is empty"),
    (b"train: [1, 2]\n", [], "train: expected a mapping"),
    (b"model: {path: [unclosed\n", [], "invalid YAML"),
    # YAML keeps the last of a key given twice: a second section would drop the first's lr.
    (b"train:\n  lr: 0.1\nmodel: {}\ntrain:\n  max_steps: 3\n", [],
     "line 1 and line 4 both set 'train' in one mapping; YAML would keep only the second"),
    (b"phase1:\n  adapters:\n    a: {data: d1}\n    b: {data: d2}\n    a: {data: d3}\n", [],
     "line 3 and line 5 both set 'a' in one mapping"),
])
def test_config_files_that_are_not_configs_are_named(tmp_path, content, overrides, message, capsys):
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    assert main.main(["--config", str(path), *overrides]) == 2
    err = capsys.readouterr().err
    assert f"error: {path}: " in err and message in err and "Traceback" not in err


def test_a_config_that_is_a_directory_is_named(tmp_path, capsys):
    assert main.main(["--config", str(tmp_path)]) == 2
    assert f"error: {tmp_path}: is a directory; --config takes a YAML file" in capsys.readouterr().err


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  max_steps: 3\n  warmup: 2\n")
    with pytest.raises(ConfigError, match=rf"{path}: unknown key train.warmup"):
        load_config(path)


def run_main(config, capsys, *extra):
    code = main.main(["--config", str(config), *extra])
    return code, capsys.readouterr().err


def test_missing_data_directory(data, tiny_model_dir, tmp_path, capsys):
    config = write_run_config(tmp_path / "r.yaml", tiny_model_dir, {1: tmp_path / "nope", 2: data[2]}, tmp_path / "o")
    code, err = run_main(config, capsys)
    assert code == 2 and "phase1.data:" in err and "does not exist" in err and "dataset.prepare" in err


def test_a_data_file_where_prepared_data_belongs_is_named_as_a_file(data, tiny_model_dir, tmp_path, capsys):
    raw = tmp_path / "chat.jsonl"
    raw.write_text('{"text": "a"}\n')
    config = write_run_config(tmp_path / "r.yaml", tiny_model_dir, {1: raw, 2: data[2]}, tmp_path / "o")
    code, err = run_main(config, capsys)
    assert code == 2 and f"phase1.data: {raw} is a file; a phase reads prepared data, the directory `python -m " \
                         f"dataset.prepare --input {raw} --out DIR` writes: set phase1.data to that DIR" in err


def test_any_phase_trains_on_either_kind_of_data(data, tiny_model_dir, tmp_path):
    """A curriculum orders its data as it likes (domain text, Q&A, more text, a task's Q&A): a
    phase takes what its data is (every token, or assistant tokens only), not what its number
    was in the two-phase curriculum."""
    from finetuning_pipeline.run.input_checks import check_inputs

    config = load_config(write_run_config(tmp_path / "r.yaml", tiny_model_dir, {1: data[2], 2: data[1]}, tmp_path / "o",
                                          phase3={"data": str(data[2]), "init": "merge"}))
    check_inputs(config, [1, 2, 3])  # raises on anything it finds


def test_shards_from_another_tokenizer(data, tiny_model_dir, tmp_path, capsys):
    other = tmp_path / "phase1"
    shutil.copytree(data[1], other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["fingerprint"] = "sha256:another-tokenizer"
    (other / "manifest.json").write_text(json.dumps(manifest))
    config = write_run_config(tmp_path / "r.yaml", tiny_model_dir, {1: other, 2: data[2]}, tmp_path / "o")
    code, err = run_main(config, capsys, "--phase", "1")
    assert code == 2 and "tokenized by tokenizer sha256:another-tokenizer, but the run's tokenizer is sha256:" in err


def test_seq_len_beyond_the_models_positions(data, tiny_model_dir, tmp_path, capsys):
    short = tmp_path / "short-model"
    shutil.copytree(tiny_model_dir, short)
    model_config = json.loads((short / "config.json").read_text())
    model_config["max_position_embeddings"] = 32
    (short / "config.json").write_text(json.dumps(model_config))
    config = write_run_config(tmp_path / "r.yaml", short, data, tmp_path / "o")
    code, err = run_main(config, capsys)
    assert code == 2 and "seq_len 64 exceeds the model's max_position_embeddings 32" in err


def test_phase2_alone_needs_the_phase1_adapter(data, tiny_model_dir, tmp_path, capsys):
    config = write_run_config(tmp_path / "r.yaml", tiny_model_dir, data, tmp_path / "o")
    code, err = run_main(config, capsys, "--phase", "2")
    assert code == 2 and "phase2.init=continue needs the phase-1 adapter" in err


def test_unwritable_output_dir_is_caught_before_training(data, tiny_model_dir, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    config = write_run_config(tmp_path / "r.yaml", tiny_model_dir, data, blocker / "out")
    code, err = run_main(config, capsys)
    assert code == 2 and "output_dir: cannot write to" in err


SHIPPED = sorted((REPO / "finetuning_pipeline" / "configs").glob("*.yaml"))


def test_every_shipped_config_is_checked():
    assert len(SHIPPED) >= 4, SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=lambda path: path.stem)
def test_shipped_configs_are_valid(path, capsys):
    config = load_config(path)
    # Every phase it writes has its data (each adapter's, side by side), from phase 1 on, and
    # the two-phase configs write both.
    written = [n for n in config.phase_numbers() if config.phase(n).data or config.phase(n).adapters]
    assert written[:1] == [1] and all(all(config.data_dirs(n).values()) for n in written)
    assert len(written) >= 2 or config.phase(1).adapters
    assert "is now called" not in capsys.readouterr().err  # no shipped config uses a renamed key


def test_compile_cache_is_on_by_default_on_tpu_only(monkeypatch, tmp_path):
    from finetuning_pipeline.runtime.xla.compile_cache import compile_cache_dir

    assert load_config(DEMO).xla.compile_cache_dir == "auto"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert compile_cache_dir("auto") == str(tmp_path / "tpu-lora" / "xla")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # XLA:CPU cannot load its own cache entries
    assert compile_cache_dir("auto") == ""
    assert compile_cache_dir("/data/xla-cache") == "/data/xla-cache" and compile_cache_dir("") == ""
