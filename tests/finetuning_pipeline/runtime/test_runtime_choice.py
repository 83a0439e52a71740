"""runtime.*: what the native runtime refuses, by key, before any device is touched; its device
choice and TorchTPU's refusal where torch_tpu is missing."""

from __future__ import annotations

import pytest

from finetuning_pipeline.run_config import ConfigError, load_config
from finetuning_pipeline.runtime.native.device import compiles_layers, native_device

pytestmark = pytest.mark.native
DEMO = "finetuning_pipeline/configs/demo.yaml"


def test_each_environment_is_the_one_it_claims():
    """`make test` runs in the pinned stack (torch 2.9.0 + torch_xla 2.9.0); `make test-native`
    (TPU_LORA_NATIVE_ENV=1) in torch within TorchTPU's range (2.11 to 2.15) and no torch_xla."""
    import importlib.util
    import os

    import torch

    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if os.environ.get("TPU_LORA_NATIVE_ENV"):
        assert (2, 11) <= version <= (2, 15) and importlib.util.find_spec("torch_xla") is None
    else:
        assert version == (2, 9) and importlib.util.find_spec("torch_xla") is not None


def test_activation_checkpointing_is_off_full_or_selective_and_true_is_full():
    from finetuning_pipeline.model.activation_checkpointing import checkpointing_mode

    for value, mode in (("false", None), ("true", "full"), ("full", "full"), ("selective", "selective")):
        setting = load_config(DEMO, ["runtime.backend=native", f"model.activation_checkpointing={value}"]).model
        assert checkpointing_mode(setting.activation_checkpointing) == mode


def test_the_default_runtime_is_auto_and_each_is_an_override():
    assert load_config(DEMO).runtime.backend == "auto"
    assert load_config(DEMO, ["runtime.backend=xla"]).runtime.backend == "xla"
    runtime = load_config(DEMO, ["runtime.backend=native", "runtime.device=cpu", "runtime.compile=layers"]).runtime
    assert (runtime.backend, runtime.device, runtime.compile) == ("native", "cpu", "layers")


@pytest.mark.parametrize("overrides, message", [
    (["runtime.backend=xla", "runtime.device=cuda"],
     r"runtime.device=cuda is the native runtime's setting; with runtime.backend=xla"),
    (["runtime.backend=xla", "runtime.compile=eager"], r"runtime.compile=eager is the native runtime's setting"),
    (["runtime.backend=native", "parallel.launcher=tpu"], r"parallel.launcher=tpu is torch_xla.s launcher"),
    (["runtime.backend=native", "train.scan_layers=true"], r"train.scan_layers=true: the layer scan is torch_xla's"),
    (["runtime.backend=native", "model.attention=splash"], r"model.attention=splash: that Pallas kernel"),
    (["runtime.backend=native", "runtime.compile=layers", "model.dtype=float64"],
     r"runtime.compile=layers with model.dtype=float64: the float64 proofs run eagerly"),
    (["runtime.backend=jax"], r"runtime.backend must be"),
    (["runtime.backend=xla", "model.activation_checkpointing=selective"],
     r"model.activation_checkpointing=selective is PyTorch's selective checkpoint, the native runtime's"),
    (["model.activation_checkpointing=some"], r"model.activation_checkpointing must be false, true, full or selective"),
])
def test_what_the_native_runtime_cannot_do_is_refused_by_its_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO, overrides)


def test_the_device_choice_and_tpu_without_torch_tpu(monkeypatch):
    import sys

    import torch

    assert native_device("cpu") == torch.device("cpu")
    assert native_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"runtime.device=cuda: PyTorch .* sees no CUDA GPU here"):
            native_device("cuda")
    monkeypatch.setitem(sys.modules, "torch_tpu", None)  # an import of it fails, installed or not
    with pytest.raises(ConfigError, match=r"runtime.device=tpu: TorchTPU is not installed .*pip install torch-tpu"):
        native_device("tpu")
    assert compiles_layers("auto", torch.device("cpu")) is False
    assert compiles_layers("auto", torch.device("cuda")) is True
    assert compiles_layers("auto", torch.device("cuda"), "float64") is False
    assert compiles_layers("layers", torch.device("cpu")) is True
    assert compiles_layers("eager", torch.device("cuda")) is False


def test_each_runtime_is_an_extra_and_the_core_pins_no_torch():
    """pyproject.toml: the core names torch by the range both runtimes run under (no pin, no
    torch_xla); `xla` pins torch_xla's stack, `gpu`/`native` a range that holds TorchTPU's
    (2.11 to 2.15) and 2.9, `tpu-native` adds TorchTPU (tests/utils/test_tpu_install.py resolves them)."""
    import tomllib
    from conftest import REPO
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    core = {r.name: r for r in map(Requirement, project["dependencies"])}
    assert "torch_xla" not in core and "torch-xla" not in core
    assert not any(s.operator == "==" for s in core["torch"].specifier)
    extras = {name: {r.name: r for r in map(Requirement, requirements)}
              for name, requirements in project["optional-dependencies"].items()}
    assert str(extras["xla"]["torch"].specifier) == "==2.9.0" and "torch_xla" in extras["xla"]
    for name in ("gpu", "native", "tpu-native", None):
        torch = extras[name]["torch"].specifier if name else core["torch"].specifier
        for version in ("2.11.0", "2.13.0", "2.15.1"):
            assert torch.contains(version), (name, version)
        assert not torch.contains("2.16.0") and (name == "tpu-native") != torch.contains("2.9.0")
        assert name is None or not {"torch_xla", "torch-xla"} & set(extras[name])
    assert str(extras["tpu-native"]["torch-tpu"].specifier) == "==0.2.0"


def test_the_peak_memory_is_the_accelerators_or_none_where_it_keeps_none(monkeypatch):
    """torch.accelerator's figure on an accelerator (a GPU's, TorchTPU's), None on a CPU, and None,
    not a failed run, where the accelerator's allocator keeps no statistics."""
    import torch

    from finetuning_pipeline.runtime.native.runtime import NativeRuntime

    runtime, tpu = NativeRuntime(torch.device("cpu"), False), torch.device("meta")  # (a device that is not a CPU)
    assert runtime.peak_memory_bytes(torch.device("cpu")) is None
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", lambda device: 3 * 2**30, raising=False)
    assert runtime.peak_memory_bytes(tpu) == 3 * 2**30

    def no_statistics(device):
        raise RuntimeError("the device allocator is not registered")

    monkeypatch.setattr(torch.accelerator, "max_memory_allocated", no_statistics, raising=False)
    assert runtime.peak_memory_bytes(tpu) is None


@pytest.fixture
def machine(monkeypatch):
    """This machine as the runtime's choice sees it, set by the test: torch_xla installed or not, TPU
    chips on the PCI bus, a GPU, PJRT_DEVICE."""
    import finetuning_pipeline.runtime as runtime

    state = {"xla": True, "chips": 0, "gpu": False}
    monkeypatch.setattr(runtime, "torch_xla_installed", lambda: state["xla"])
    monkeypatch.setattr(runtime, "tpu_chips", lambda: state["chips"])
    monkeypatch.setattr(runtime, "gpu_present", lambda: state["gpu"])
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    return state


def chosen(overrides=()):
    from finetuning_pipeline.runtime import choose_backend

    return choose_backend(load_config(DEMO, list(overrides)).runtime)


def test_auto_takes_xla_where_a_tpu_is_or_pjrt_device_is_set_native_on_a_gpu_and_xla_elsewhere(machine, monkeypatch):
    assert chosen() == ("xla", "runtime.backend=auto, no TPU or GPU here: XLA on the CPU, as a TPU would run")
    machine["gpu"] = True
    assert chosen() == ("native", "runtime.backend=auto, a GPU and no TPU here")
    machine["chips"] = 4  # a TPU VM (with a GPU too, however unlikely): the TPU's runtime
    assert chosen() == ("xla", "runtime.backend=auto and 4 TPU chips are attached")
    machine["chips"] = 0
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # `make demo`, the tests: XLA:CPU, whatever else is here
    assert chosen() == ("xla", "runtime.backend=auto and PJRT_DEVICE=CPU is set")
    assert chosen(["runtime.compile=eager"])[0] == "native"  # a native-only setting names the runtime
    assert chosen(["runtime.backend=native"]) == ("native", "runtime.backend=native")


def test_without_torch_xla_auto_is_native_and_xla_is_refused_in_one_line(machine, monkeypatch):
    """The native environment (a GPU user's torch, TorchTPU's VM) has no torch_xla: auto is native
    there even where PJRT_DEVICE is set, and runtime.backend=xla says what to install."""
    machine["xla"] = False
    assert chosen() == ("native", "runtime.backend=auto and torch_xla is not installed here")
    monkeypatch.setenv("PJRT_DEVICE", "TPU")  # not quietly ignored: said to be torch_xla's
    assert chosen() == ("native", "runtime.backend=auto and torch_xla is not installed here; PJRT_DEVICE=TPU is "
                                  "torch_xla's and not read here (runtime.device picks the native runtime's device)")
    with pytest.raises(ConfigError, match=r"runtime.backend=xla: torch_xla is not installed in this environment; "
                                          r"pip install -e '.\[xla\]'"):
        chosen(["runtime.backend=xla"])


def test_the_resolved_backend_is_checked_as_if_it_had_been_named(machine, monkeypatch):
    """auto resolved to xla refuses the native runtime's settings as runtime.backend=xla does; the
    config then holds the runtime that runs (what the summary and checkpoints record)."""
    import torch

    from finetuning_pipeline.runtime import backend, choice_line

    config = load_config(DEMO, ["train.scan_layers=true"])
    machine["gpu"] = True
    with pytest.raises(ConfigError, match="train.scan_layers=true: the layer scan is torch_xla's"):
        backend(config)
    config = load_config(DEMO)
    chosen = backend(config)
    assert config.runtime.backend == chosen.name == "native"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (the machine's GPU, without a device started)
    assert choice_line(chosen, config) == ("runtime: native on cuda (runtime.device=auto) (runtime.backend=auto, a "
                                           "GPU and no TPU here)")


def test_the_commands_that_can_take_xla_say_in_one_line_where_torch_xla_is_not_installed(monkeypatch, capsys):
    """evaluate --device xla, and tpu-check's device in the native environment: a line, not
    ModuleNotFoundError, and no PJRT advice where PJRT is not there (tpu_check reads the chips as
    torch_xla would, and a pod's hosts are not asked of torch_xla)."""
    from finetuning_pipeline import evaluate, tpu_check

    monkeypatch.setattr(evaluate, "torch_xla_installed", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        evaluate.main(["--model", "M", "--data", "D", "--device", "xla"])
    assert exit_.value.code == 2
    assert ("--device xla: torch_xla is not installed in this environment; pip install -e '.[xla]' (torch 2.9.0 + "
            "torch_xla 2.9.0), or evaluate on the host with --device cpu") in capsys.readouterr().err
    import finetuning_pipeline.runtime.xla.device as xla_device

    monkeypatch.setattr(tpu_check, "torch_xla_installed", lambda: False)
    for chips, device in ((0, "CPU"), (4, "TPU")):
        monkeypatch.delenv("PJRT_DEVICE", raising=False)
        monkeypatch.setattr(xla_device, "tpu_chips", lambda chips=chips: chips)
        assert tpu_check.check_device() == device and capsys.readouterr().err == ""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert tpu_check.check_device() == "CPU"
    monkeypatch.setenv("PJRT_DEVICE", "cuda")
    with pytest.raises(ConfigError, match="PJRT_DEVICE='cuda': the XLA runtime runs on PJRT_DEVICE=CPU or "):
        tpu_check.check_device()


def test_the_runtime_and_its_reason_are_of_the_environment_the_command_started_in(machine, monkeypatch):
    """main.py without --config prepares the embedded default, which sets PJRT_DEVICE for its own
    imports: the run's first line then said `PJRT_DEVICE=CPU is set`, which the user never set."""
    import os
    from pathlib import Path

    from finetuning_pipeline import main
    from finetuning_pipeline.runtime import choose_backend

    runtime = load_config(DEMO).runtime
    assert choose_backend(runtime, {}) == (
        "xla", "runtime.backend=auto, no TPU or GPU here: XLA on the CPU, as a TPU would run")
    assert choose_backend(runtime, {"PJRT_DEVICE": "CPU"})[1] == "runtime.backend=auto and PJRT_DEVICE=CPU is set"

    class Chosen(Exception):
        pass

    def demo_config(given, overrides, phase="all"):
        os.environ["PJRT_DEVICE"] = "CPU"  # what preparing the embedded default does (monkeypatch restores it)
        return Path(DEMO), overrides

    def backend(config, environ=None):
        raise Chosen(choose_backend(config.runtime, environ))

    monkeypatch.setattr(main, "choose_config", demo_config)
    monkeypatch.setattr(main, "backend", backend)
    with pytest.raises(Chosen) as chosen_:
        main.train([])
    assert chosen_.value.args[0][1] == "runtime.backend=auto, no TPU or GPU here: XLA on the CPU, as a TPU would run"


@pytest.mark.parametrize("command", ["evaluate", "generate"])
def test_evaluate_and_generate_take_trainings_device_words(command, capsys):
    """--device auto (the default: a CUDA GPU where PyTorch sees one, else the CPU), cpu, cuda, tpu
    (TorchTPU), as runtime.device; a device that is not here is one line, before anything loads.
    (Their GPU path itself is a GPU's to run: unmeasured here.)"""
    import importlib

    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: --device cuda is taken")
    module = importlib.import_module(f"finetuning_pipeline.{command}")
    argv = ["--model", "M", "--data", "D"] if command == "evaluate" else ["--model", "M", "--prompt", "Salut"]
    assert module.main([*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device cuda: PyTorch ") and "sees no CUDA GPU here" in err, err
    assert "use --device cpu or auto" in err and "Traceback" not in err


def test_generate_runs_in_the_dtype_asked_on_the_device_asked(tiny_model_dir, monkeypatch):
    """generate(device, dtype): the model it answers with is in that dtype, on that device (bfloat16
    on the CPU here; a GPU's is the same call), and float32 by default."""
    import torch

    from finetuning_pipeline import generate

    loaded = []
    load = generate.load_model

    def recorded(*args, **kwargs):
        model, adapters = load(*args, **kwargs)
        loaded.append(model)
        return model, adapters

    monkeypatch.setattr(generate, "load_model", recorded)
    for dtype, expected in ((None, torch.float32), ("bfloat16", torch.bfloat16)):
        answer = generate.generate(str(tiny_model_dir), "Salut", max_new_tokens=4, device=torch.device("cpu"),
                                   **({"dtype": dtype} if dtype else {}))
        weights = {(p.dtype, p.device.type) for p in loaded[-1].parameters()}
        assert weights == {(expected, "cpu")} and isinstance(answer, str), (dtype, weights)
