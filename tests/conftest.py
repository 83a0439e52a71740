"""Shared fixtures: CPU-only XLA, a seed, tiny causal LMs of several architectures. In the native
runtime's environment (`make test-native`: no torch_xla) the same fixtures, without XLA."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
from pathlib import Path

# Before anything imports torch_xla: run the real XLA path on the host CPU.
os.environ.setdefault("PJRT_DEVICE", "CPU")
# Nothing in the tests reaches the Hugging Face Hub: a Hub id is read from a local cache.
os.environ["HF_HUB_OFFLINE"] = "1"
# Two test workers share two cores, each running torch's threads and starting processes that run
# theirs: an OpenMP thread with no work spins before it sleeps, on a core another process needs.
# Waiting passively, the demo base's pretraining twice at once took 46 s and 51 CPU-s each where
# spinning took 155 s and 160 CPU-s (alone 41 s against 28 s), and wrote the same bytes; `make
# test` took 1,519 s against 1,764 s (docs/development.md). torch's OpenMP library reads it as
# torch is imported (below); the processes the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# inductor compiles in the process that compiles, not in a pool of two more processes (each
# importing torch) started by every process that compiles: the native compiled-layers run alone,
# inductor's cache cold, took 91 s and 91 CPU-s against 104 s and 118 (docs/development.md). The
# same code is generated.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from finetuning_pipeline.runtime.xla.device import init_xla_device

# Before any test runs a backward (see init_xla_device for why); not where torch_xla is absent.
if importlib.util.find_spec("torch_xla") is not None:
    init_xla_device()
# What the imports built, out of the collector's reach: a test's collections never walk it again
# (an in-process test file took 8% less, farm-bench; utils/startup.py does this in a trainer process).
gc.freeze()

REPO = Path(__file__).resolve().parent.parent  # the repository root
VOCAB = 128
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
CONFIGS = {
    "mistral": lambda: MistralConfig(**SHAPE, sliding_window=None),
    "llama": lambda: LlamaConfig(**SHAPE),
    "qwen2": lambda: Qwen2Config(**SHAPE),
    "gemma": lambda: GemmaConfig(**SHAPE),
    "gemma3": lambda: Gemma3TextConfig(**SHAPE, sliding_window=16),
}
ARCHITECTURES = list(CONFIGS)


def tiny_causal_lm(arch: str, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised 2-layer model of `arch`, fp32, in eval mode (no dropout)."""
    torch.manual_seed(seed)
    config = CONFIGS[arch]()
    model_cls = Gemma3ForCausalLM if arch == "gemma3" else AutoModelForCausalLM
    model = model_cls.from_config(config) if model_cls is AutoModelForCausalLM else model_cls(config)
    return model.float().eval()


@contextlib.contextmanager
def saved_for_backward(model: torch.nn.Module):
    """Within the block, the bytes of each tensor autograd saves for the backward that is not one of
    `model`'s own parameters or buffers (by storage): the activations a backward keeps alive."""
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    kept: list[int] = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in owned:
            kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield kept


def random_tokens(batch: int = 2, seq: int = 12, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=generator)


@pytest.fixture
def seed() -> int:
    torch.manual_seed(1234)
    return 1234


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The demo's tiny Mistral + tokenizer, built once per test session."""
    from finetuning_pipeline.demo.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "base", seed=0)


@pytest.fixture(scope="session")
def data(tiny_model_dir, tmp_path_factory):
    """The bundled corpora prepared for both phases on the tiny model's tokenizer, once per test
    session: the trainer's tests read it and never write it (each run writes its own output_dir)."""
    from trainer_helpers import prepare_demo_data

    return prepare_demo_data(tiny_model_dir, tmp_path_factory.mktemp("data"))


E2E = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(config, items):
    """tests/e2e/ holds the end-to-end runs (the commands as users run them, through the
    trainer): all of them are slow, and `make test-fast` leaves them out.

    The files that hold slow tests run first (the Makefile turns off xdist's own order, which puts
    the files of many tests first and so the long end-to-end files last): a worker that takes one
    late would leave the other cores idle until it ends, and the many short files fill the end."""
    for item in items:
        if item.path.is_relative_to(E2E):
            item.add_marker(pytest.mark.slow)
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # (stable: each file's own order kept)
