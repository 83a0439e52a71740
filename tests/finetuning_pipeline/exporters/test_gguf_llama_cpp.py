"""The GGUF export judged by llama.cpp itself (llama-cpp-python, built from its vendored source by
utils/llama_cpp_install.sh): for the tiny model of every family, llama.cpp's logits on the GGUF
equal transformers' on the merged Hugging Face export; the base's GGUF with the adapter's GGUF
applied equals the merged GGUF; llama.cpp's tokenizer gives transformers' ids for the chat data.

llama.cpp runs with flash attention off and an fp32 KV cache, so an f32 GGUF is computed in fp32
throughout: the bound 1e-4 on logits of magnitude about 1 is rounding in fp32 summed in another
order, far below what a wrong tensor layout, a missed norm shift or a lost adapter scaling moves
(the negative control moves them by about 0.1).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from gguf_models import (
    GGUF_FAMILIES,
    byte_level_tokenizer,
    tokenizer_for,
    write_family_model,
    write_random_adapter,
)
from transformers import AutoModelForCausalLM

from dataset.samples import CHAT_QA, DOMAIN_TEXT
from finetuning_pipeline import export
from finetuning_pipeline.demo.tiny_model import train_sentencepiece
from finetuning_pipeline.exporters import gguf_export
from finetuning_pipeline.exporters.gguf_vocab import LLAMA3_SPLIT

if os.environ.get("REQUIRE_LLAMA_CPP"):  # make test: a missing llama.cpp fails these tests, never skips them
    import llama_cpp
else:
    llama_cpp = pytest.importorskip("llama_cpp", reason="make test installs llama.cpp (utils/llama_cpp_install.sh)")

F32_BOUND = 1e-4
LENGTH = 24  # longer than Gemma's windows of 6 here: the sliding layers are tested


def run_export(*args) -> None:
    assert export.main([*map(str, args)]) == 0


def llama_cpp_logits(path, ids: list[int], lora=None) -> np.ndarray:
    """llama.cpp's logits for every position of `ids`, computed in fp32 (no flash attention, an
    F32 KV cache)."""
    model = llama_cpp.Llama(str(path), n_ctx=64, n_batch=64, logits_all=True, verbose=False, n_threads=2,
                            type_k=0, type_v=0, flash_attn=False, seed=0,
                            **({"lora_path": str(lora)} if lora else {}))
    try:
        model.eval(ids)
        return np.array(model.scores[:len(ids)])
    finally:
        model.close()


def ggml_gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU as llama.cpp computes it on a CPU (ggml-cpu/vec.h, GGML_GELU_FP16): the tanh
    approximation looked up in a table of fp16 values at the input rounded to fp16; 0 below -10, x
    above 10. transformers computes it in fp32: the two differ by up to about 1e-3 relative."""
    looked_up = torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, looked_up))


class GgmlGelu(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ggml_gelu(x)


def transformers_logits(directory, ids: list[int], as_ggml: bool = True) -> np.ndarray:
    """The model's logits in fp32; as_ggml: with GELU as llama.cpp computes it (Gemma's MLPs), so
    that what remains between the two is the export's doing."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    if as_ggml:
        for module in model.modules():
            if hasattr(module, "act_fn") and "gelu" in str(getattr(model.config, "hidden_activation", None)
                                                            or model.config.hidden_act):
                module.act_fn = GgmlGelu()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def sample_ids(family: str) -> list[int]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(4, len(tokenizer_for(family)), (LENGTH,), generator=generator).tolist()


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    """{family: (base dir, adapter dir, merged HF dir)}, built once for the module."""
    made = {}

    def files(family: str):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            base = write_family_model(root / "base", family)
            adapter = write_random_adapter(root / "adapter", base, family, seed=1)
            run_export("--base", base, "--adapter", adapter, "--out", root / "merged", "--dtype", "float32")
            made[family] = base, adapter, root / "merged"
        return made[family]

    return files


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_merged_gguf_gives_transformers_logits_and_base_plus_adapter_gives_the_merged(family, family_files,
                                                                                       tmp_path):
    base, adapter, merged = family_files(family)
    ids = sample_ids(family)
    run_export("--format", "gguf", "--outtype", "f32", "--base", base, "--adapter", adapter,
               "--out", tmp_path / "merged.gguf")
    expected = transformers_logits(merged, ids)
    got = llama_cpp_logits(tmp_path / "merged.gguf", ids)
    assert np.abs(got - expected).max() < F32_BOUND, np.abs(got - expected).max()

    run_export("--format", "gguf", "--outtype", "f32", "--base", base, "--out", tmp_path / "base.gguf")
    run_export("--format", "gguf", "--outtype", "f32", "--adapter-only", "--base", base, "--adapter", adapter,
               "--out", tmp_path / "adapter.gguf")
    applied = llama_cpp_logits(tmp_path / "base.gguf", ids, lora=tmp_path / "adapter.gguf")
    assert np.abs(applied - got).max() < F32_BOUND, np.abs(applied - got).max()
    # The adapter matters here: without it, llama.cpp computes the base's logits.
    assert np.abs(llama_cpp_logits(tmp_path / "base.gguf", ids) - got).max() > 100 * F32_BOUND


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_an_adapter_without_the_rotary_permutation_fails_the_check(family, family_files, tmp_path, monkeypatch):
    """The negative control: llama.cpp's llama pairs rotary dimensions otherwise than
    transformers, so an adapter whose B rows of q and k are left in transformers' order computes
    something else, and the check above catches it."""
    base, adapter, _ = family_files(family)
    ids = sample_ids(family)
    run_export("--format", "gguf", "--outtype", "f32", "--base", base, "--adapter", adapter,
               "--out", tmp_path / "merged.gguf")
    run_export("--format", "gguf", "--outtype", "f32", "--base", base, "--out", tmp_path / "base.gguf")
    monkeypatch.setattr(gguf_export, "permute_rotary_rows", lambda rows, heads: rows)
    run_export("--format", "gguf", "--outtype", "f32", "--adapter-only", "--base", base, "--adapter", adapter,
               "--out", tmp_path / "unpermuted.gguf")
    merged = llama_cpp_logits(tmp_path / "merged.gguf", ids)
    applied = llama_cpp_logits(tmp_path / "base.gguf", ids, lora=tmp_path / "unpermuted.gguf")
    assert np.abs(applied - merged).max() > 100 * F32_BOUND


def chat_data() -> list[list[dict]]:
    with open(CHAT_QA, encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f]


@pytest.mark.parametrize("family,kind", [("mistral", "json"), ("mistral", "model file"), ("qwen2", "json"),
                                         ("llama", "llama 3")])
def test_llama_cpp_tokenizes_the_chat_data_as_transformers(family, kind, family_files, tmp_path):
    """sentencepiece's BPE as tokenizer.json holds it, and with its model file (tokenizer.model,
    as Llama 2's, Mistral's and Gemma's downloads have it; read in its place); byte-level BPE
    split as Qwen2's, and as Llama 3's (with ignore_merges: a word in the vocabulary is one token)."""
    base, _, _ = family_files(family)
    tokenizer = tokenizer_for(family)
    if kind == "llama 3":
        tokenizer = byte_level_tokenizer(LLAMA3_SPLIT, ignore_merges=True)
        base = write_family_model(tmp_path / "llama3", family, tokenizer=tokenizer)
    if kind == "model file":
        copy = tmp_path / "with-model-file"
        copy.mkdir()
        for path in base.iterdir():
            (copy / path.name).write_bytes(path.read_bytes())
        (copy / "tokenizer.model").write_bytes(train_sentencepiece())
        base = copy
    run_export("--format", "gguf", "--outtype", "f16", "--base", base, "--out", tmp_path / "base.gguf")
    model = llama_cpp.Llama(str(tmp_path / "base.gguf"), n_ctx=64, verbose=False, vocab_only=True)
    conversations = chat_data()
    assert len(conversations) > 50
    for messages in conversations:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        # The template's text as the model sees it, and with what the tokenizer adds around a
        # text (a BOS or not: llama.cpp adds what the GGUF says transformers adds).
        assert model.tokenize(text.encode(), add_bos=False, special=True) == \
            tokenizer(text, add_special_tokens=False)["input_ids"], text
        assert model.tokenize(text.encode(), add_bos=True, special=True) == tokenizer(text)["input_ids"], text
    # A text that starts with a word: transformers' sentencepiece puts its '\u2581' before the first
    # word only, which llama.cpp cannot (gguf_vocab.space_prefix): written as "never", so the text
    # with a leading space gives transformers' ids. A byte-level tokenizer has no such marker.
    lead = " " if family == "mistral" else ""
    for messages in conversations:
        words = messages[-1]["content"]
        assert model.tokenize((lead + words).encode(), add_bos=False, special=True) == \
            tokenizer(words, add_special_tokens=False)["input_ids"], words
    model.close()


def kl_divergence(reference: np.ndarray, other: np.ndarray) -> np.ndarray:
    """KL(reference || other) of the next-token distributions at each position, in float64."""
    p = torch.log_softmax(torch.from_numpy(reference).double(), -1)
    q = torch.log_softmax(torch.from_numpy(other).double(), -1)
    return (p.exp() * (p - q)).sum(-1).numpy()


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_half_and_q8_0_gguf_of_every_family_stay_close_to_f32(family, family_files, tmp_path):
    """Each family's weights in f16 and in ggml's q8_0 blocks, as llama.cpp reads them. A random
    model's next-token distributions are nearly flat, so these bounds are on KL only (largest
    seen: f16 3.2e-7, q8_0 3.4e-4); the argmax is checked on a trained model below. A wrong block
    layout or a tensor in the wrong type gives KL of order 1."""
    base, adapter, _ = family_files(family)
    ids = sample_ids(family)
    logits = {}
    for outtype in ("f32", "f16", "q8_0"):
        run_export("--format", "gguf", "--outtype", outtype, "--base", base, "--adapter", adapter,
                   "--out", tmp_path / f"{outtype}.gguf")
        logits[outtype] = llama_cpp_logits(tmp_path / f"{outtype}.gguf", ids)
    assert kl_divergence(logits["f32"], logits["f16"]).max() < 1e-5
    assert (logits["f16"].argmax(-1) == logits["f32"].argmax(-1)).all()
    assert kl_divergence(logits["f32"], logits["q8_0"]).max() < 1e-2


@pytest.fixture(scope="module")
def trained_base(tmp_path_factory):
    """The demo's base: pretrained on the bundled domain text (about 20 s)."""
    from finetuning_pipeline.demo.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("trained") / "base", seed=0, pretrain_steps=600,
                            log=lambda *_: None)


@pytest.mark.slow
def test_generate_on_a_gguf_answers_as_on_the_model(trained_base, tmp_path):
    """`generate --model X.gguf` runs llama.cpp with the chat template the file carries: greedy, it
    gives transformers' greedy answer on the same model."""
    from finetuning_pipeline.generate import generate, generate_gguf

    run_export("--format", "gguf", "--outtype", "f16", "--base", trained_base, "--out", tmp_path / "m.gguf")
    for prompt in ("Care este reședința județului Cluj?", "Ce se poate vizita în județul Brașov?"):
        expected = generate(str(trained_base), prompt, max_new_tokens=24)
        assert generate_gguf(str(tmp_path / "m.gguf"), prompt, max_new_tokens=24) == expected
        assert len(expected.split()) > 3


@pytest.mark.slow
def test_a_trained_model_keeps_its_answers_in_every_outtype(trained_base, tmp_path):
    """The demo's base, pretrained on the bundled domain text (peaked distributions, as a trained
    model's are), on that text: f16, bf16 and q8_0 give the argmax of transformers' fp32 logits at
    every position. KL bounds about ten times the largest seen (f16 3.6e-6, bf16 3.8e-4, q8_0
    1.1e-3; q4_0 0.20, with 95% of the argmaxes kept: 4 bits a weight on a model this small)."""
    from transformers import AutoTokenizer

    base = trained_base
    tokenizer = AutoTokenizer.from_pretrained(base)
    with open(DOMAIN_TEXT, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f][:8]
    bounds = {"f16": 1e-4, "bf16": 1e-2, "q8_0": 1e-2, "q4_0": 1.0}
    for outtype in bounds:
        run_export("--format", "gguf", "--outtype", outtype, "--base", base, "--out", tmp_path / f"{outtype}.gguf")
    kept_q4 = []
    for text in texts:
        ids = tokenizer(text)["input_ids"][:60]
        reference = transformers_logits(base, ids)
        for outtype, bound in bounds.items():
            logits = llama_cpp_logits(tmp_path / f"{outtype}.gguf", ids)
            assert kl_divergence(reference, logits).max() < bound, outtype
            same = logits.argmax(-1) == reference.argmax(-1)
            if outtype == "q4_0":
                kept_q4.append(same.mean())
            else:
                assert same.all(), outtype
    assert np.mean(kept_q4) > 0.9


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_stacked_adapters_of_other_ranks_targets_and_rslora_export_as_one(family, family_files, tmp_path):
    """Two adapters stacked (the second of another rank, on fewer modules, with rsLoRA's scaling):
    merged, they give transformers' logits on the Hugging Face export of the same stack; as one
    LoRA GGUF (the summed rank, zeros where the second has no module) on the base's GGUF, the
    merged GGUF's."""
    base, first, _ = family_files(family)
    second = write_random_adapter(tmp_path / "second", base, family, seed=2, r=2, alpha=3, use_rslora=True,
                                  targets=["q_proj", "v_proj", "down_proj"])
    ids = sample_ids(family)
    stack = ["--adapter", first, "--adapter", second]
    run_export("--base", base, *stack, "--out", tmp_path / "merged", "--dtype", "float32")
    run_export("--format", "gguf", "--outtype", "f32", "--base", base, *stack, "--out", tmp_path / "merged.gguf")
    merged = llama_cpp_logits(tmp_path / "merged.gguf", ids)
    assert np.abs(merged - transformers_logits(tmp_path / "merged", ids)).max() < F32_BOUND
    run_export("--format", "gguf", "--outtype", "f32", "--base", base, "--out", tmp_path / "base.gguf")
    run_export("--format", "gguf", "--outtype", "f32", "--adapter-only", "--base", base, *stack,
               "--out", tmp_path / "stack.gguf")
    applied = llama_cpp_logits(tmp_path / "base.gguf", ids, lora=tmp_path / "stack.gguf")
    assert np.abs(applied - merged).max() < F32_BOUND
    # The second adapter counts: the first alone gives other logits.
    run_export("--format", "gguf", "--outtype", "f32", "--adapter-only", "--base", base, "--adapter", first,
               "--out", tmp_path / "first.gguf")
    alone = llama_cpp_logits(tmp_path / "base.gguf", ids, lora=tmp_path / "first.gguf")
    assert np.abs(alone - merged).max() > 100 * F32_BOUND


def test_combined_adapters_export_to_gguf_as_to_transformers(family_files, tmp_path):
    base, first, _ = family_files("qwen2")
    second = write_random_adapter(tmp_path / "second", base, "qwen2", seed=2)
    ids = sample_ids("qwen2")
    combine = ["--adapter", first, "--adapter", second, "--combine", "linear", "--weights", "0.7,0.3"]
    run_export("--base", base, *combine, "--out", tmp_path / "merged", "--dtype", "float32")
    run_export("--format", "gguf", "--outtype", "f32", "--base", base, *combine, "--out", tmp_path / "merged.gguf")
    merged = llama_cpp_logits(tmp_path / "merged.gguf", ids)
    assert np.abs(merged - transformers_logits(tmp_path / "merged", ids)).max() < F32_BOUND
    run_export("--format", "gguf", "--outtype", "f32", "--base", base, "--out", tmp_path / "base.gguf")
    run_export("--format", "gguf", "--outtype", "f32", "--base", base, *combine, "--adapter-only",
               "--out", tmp_path / "combined.gguf")
    applied = llama_cpp_logits(tmp_path / "base.gguf", ids, lora=tmp_path / "combined.gguf")
    assert np.abs(applied - merged).max() < F32_BOUND


ROPE_SCALINGS = {
    "llama": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16, "rope_theta": 500000.0},
    "qwen2": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0},
    "mistral": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "gemma3": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
}


@pytest.mark.parametrize("family", sorted(ROPE_SCALINGS))
def test_rope_scalings_reach_llama_cpp(family, tmp_path):
    """Llama 3's frequency factors (written as rope_freqs), YaRN, linear scaling, and Gemma 3's
    scaled global layers beside its local ones with their own base: each moves transformers'
    logits (by 1e-3 to 0.25 here), and llama.cpp follows within the f32 bound."""
    ids = sample_ids(family)
    base = write_family_model(tmp_path / "scaled", family, rope_parameters=ROPE_SCALINGS[family])
    plain = write_family_model(tmp_path / "plain", family)
    run_export("--format", "gguf", "--outtype", "f32", "--base", base, "--out", tmp_path / "scaled.gguf")
    expected = transformers_logits(base, ids)
    assert np.abs(expected - transformers_logits(plain, ids)).max() > 5 * F32_BOUND
    assert np.abs(llama_cpp_logits(tmp_path / "scaled.gguf", ids) - expected).max() < F32_BOUND


def test_generate_refuses_a_file_llama_cpp_cannot_load_in_one_line(tmp_path, capsys):
    from finetuning_pipeline import generate

    (tmp_path / "notes.gguf").write_text("not a model")
    assert generate.main(["--model", str(tmp_path / "notes.gguf"), "--prompt", "?"]) == 2
    assert "llama.cpp cannot load it" in capsys.readouterr().err
