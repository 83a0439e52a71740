# Everything runs inside .venv, which `setup` creates from pyproject.toml. Every target that
# needs Python depends on the install stamp, so a first `make test` on a fresh clone sets up
# everything, and a second `make setup` on a ready venv does nothing (the stamp is newer than
# pyproject.toml).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LLAMA_CPP := $(VENV)/.llama_cpp
# The native runtime's second environment: the project's `native` extra with torch in TorchTPU's
# range (2.13.0: a CPU build of it lies on this project's CI machines), no torch_xla.
VENV_NATIVE := .venv-native
NATIVE_TORCH := 2.13.0
NATIVE_STAMP := $(VENV_NATIVE)/.installed
# Its tests: those marked `native` in the files that import no torch_xla. Its end-to-end runs
# (native and slow) run here only, under TorchTPU's torch; `make test` runs its unit tests too,
# under torch 2.9.0.
NATIVE_TESTS := tests/finetuning_pipeline/runtime tests/lora_logic/test_compile.py tests/e2e/test_native_runtime.py \
	tests/finetuning_pipeline/test_cli.py tests/finetuning_pipeline/test_runtime_seam.py \
	tests/finetuning_pipeline/train/test_phase_data.py tests/finetuning_pipeline/distributed/test_resume_command.py \
	tests/finetuning_pipeline/distributed/test_torchrun_agent.py \
	tests/finetuning_pipeline/planning/test_gpu_plan.py \
	tests/utils/test_tpu_install.py \
	tests/e2e/test_native_processes.py tests/e2e/test_tpu_check.py
# The tests run on every core, a file to a worker (pytest-xdist: a file's module fixtures, its
# reference runs, are built once), the files of slow tests first (tests/conftest.py: xdist's own
# order, the files of most tests first, would leave the long end-to-end files to the end); PARALLEL=
# runs them in this one process.
XDIST := pytest-xdist==3.8.0
PARALLEL ?= -n auto --dist loadfile --no-loadscope-reorder
# XLA runs on the host CPU unless told otherwise (on a TPU VM: PJRT_DEVICE=TPU make ...).
PJRT_DEVICE ?= CPU
export PJRT_DEVICE

# The run config of `make phase1`, `make phase2`, ... `make phaseN`; extra overrides go in ARGS, e.g.
#   make phase1 CONFIG=my.yaml ARGS="train.max_steps=500 output_dir=outputs/try2"
DEMO_CONFIG := finetuning_pipeline/configs/demo.yaml
CONFIG ?= $(DEMO_CONFIG)
ARGS ?=
DEMO := outputs/demo
# Where `make demo` trains: the demo config's output_dir, or the one ARGS sets (output_dir=DIR);
# the merge, the questions and the GGUF read that run's adapter and write beside it.
DEMO_RUN = $(or $(patsubst output_dir=%,%,$(lastword $(filter output_dir=%,$(ARGS)))),$(DEMO))
DEMO_BASE := $(DEMO)/base/config.json
DEMO_DATA := $(DEMO)/data/phase1/manifest.json $(DEMO)/data/phase2/manifest.json $(DEMO)/data/phase3/manifest.json
SAMPLES := dataset/samples
DEMO_QUESTION := În ce regiune istorică se află județul Brașov?
DEMO_ANSWER := Județul Brașov se află în Transilvania.
# The demo config's phases need the demo's base model and prepared data; other configs bring their own.
PHASE_DEPS := $(if $(filter $(DEMO_CONFIG),$(CONFIG)),$(DEMO_DATA),)

# phase1, phase2, ... are a pattern rule (below): make skips pattern rules for .PHONY targets.
.PHONY: help setup setup-native llama-cpp test test-fast test-native lint tiny-model demo-data demo preflight tpu-check bench bench-train bench-host bench-lora-cost bench-prepare bench-memory bench-side-by-side bench-quantized bench-quantized-load bench-gguf-export bench-stop bench-preference bench-embeddings clean

help:
	@echo "make setup       create .venv with the xla extra (torch 2.9.0 + torch_xla 2.9.0) and test tools"
	@echo "make test        run the test suite on CPU (PJRT_DEVICE=CPU), on every core (PARALLEL= : one process);"
	@echo "                 sets up .venv first if needed; the native runtime's end-to-end runs are test-native's"
	@echo "make test-fast   the quick unit tests (pytest -m 'not slow and not heavy': no end-to-end runs, no proof over ~4 s), for the inner loop"
	@echo "make setup-native  .venv-native: the native extra with torch 2.13.0 (TorchTPU's range), no torch_xla"
	@echo "make test-native the native runtime's tests in .venv-native (sets it up first if needed)"
	@echo "make lint        ruff: imports, unused code, line length (configured in pyproject.toml; CI runs it)"
	@echo "make demo        the whole curriculum on the tiny model, on XLA:CPU: base model -> prepare ->"
	@echo "                 phase 1 -> phase 2 -> phase 3 (DPO) -> merged export -> a generated answer -> Q8_0 GGUF -> loss.png"
	@echo "make phase1      phase 1 of CONFIG (default: the demo config); extra overrides in ARGS=\"k=v ...\""
	@echo "make phase2      phase 2 of CONFIG (make phase3, phase4, ... for a longer curriculum)"
	@echo "make preflight   check CONFIG and plan its TPU time (HBM, step time, TPU-hours) on this CPU, with a"
	@echo "                 rehearsal on a shrunken model; ARGS=\"tpu.type=v5e-8 parallel.mode=fsdp\" (preflight.json);"
	@echo "                 a GPU's memory and GPU-hours with ARGS=\"runtime.backend=native gpu.type=l4 gpu.count=1\""
	@echo "make tpu-check   the first command on a TPU VM (PJRT_DEVICE=TPU make tpu-check CONFIG=...): every"
	@echo "                 TPU-only path of CONFIG on a 2-layer copy of its model, one line each (tpu_check.json)"
	@echo "make tiny-model  build and pretrain the tiny demo base model + tokenizer (outputs/demo/base)"
	@echo "make llama-cpp   install llama.cpp's Python binding (built from source once, cached in ~/.cache/tpu-lora)"
	@echo "make bench       the benchmarks below (about 45 minutes on 2 cores)"
	@echo "make bench-train our trainer vs HF Trainer + PEFT on XLA:CPU, two shapes (outputs/bench/bench.json)"
	@echo "make bench-host  host time per step and compile time, 32 layers, grad_accum 1 and 8, captured vs traced"
	@echo "make bench-lora-cost  the LoRA's products, q/k/v with and without a shared A product, the step's kernels (2 minutes)"
	@echo "make bench-prepare  measure dataset.prepare throughput and peak memory (a few minutes)"
	@echo "make bench-memory   peak memory of a step with a 262k vocabulary: chunked loss, full logits, HF + PEFT"
	@echo "make bench-side-by-side  4 adapters side by side in one run vs 4 runs one after another (2 minutes)"
	@echo "make bench-quantized     a LoRA step on a q8_0 / q4_0 / nf4 base vs the bf16 base: step time, base bytes"
	@echo "make bench-quantized-load  the host memory of loading a 675M base quantized, from fp16 and bf16 files"
	@echo "make bench-gguf-export     the host memory of export --format gguf on a 675M model (about a minute)"
	@echo "make bench-stop  from SIGTERM to a complete checkpoint with steps slow on the device (under a minute)"
	@echo "make bench-preference  a DPO step (reference in the step, or precomputed) vs an SFT step on the same tokens"
	@echo "make bench-embeddings  phase 1 with the LoRA alone, + the whole embeddings, + new tokens' rows: held-out loss, memory"
	@echo "make clean       remove outputs/ and caches (keeps .venv)"

setup: $(STAMP)

# uv installs the extras: the versions pip resolves, in 63 s where pip took 230 s (2 cores, each
# with its download cache, 2026-11-29), compiled to bytecode as pip does (without it, under
# PYTHONDONTWRITEBYTECODE=1 every process would compile torch's sources again). On a TPU VM,
# utils/tpu_vm/'s install made .venv (Python 3.11, torch's CPU build, the tpu extra) and marked
# it .venv/.tpu: every target runs in that install, and a changed pyproject.toml updates its tpu
# extra there (never a second venv with the test extra, which has neither libtpu nor jax).
$(STAMP): pyproject.toml
	@if [ -e $(VENV)/.tpu ]; then \
		echo "$(VENV) is the TPU's install (utils/tpu_vm/): updating its tpu extra"; \
		$(BIN)/python -m pip install --quiet -e '.[tpu]'; \
	else \
		set -e; $(PYTHON) -m venv $(VENV); \
		$(BIN)/python -m pip install --quiet --upgrade pip uv; \
		$(BIN)/python -m uv pip install --quiet --compile-bytecode --python $(BIN)/python -e '.[xla,test]'; \
	fi
	touch $@

# llama.cpp's Python binding, the judge of the GGUF files `export --format gguf` writes: built
# from source once per version and cached outside the checkout (utils/llama_cpp_install.sh).
$(LLAMA_CPP): $(STAMP) utils/llama_cpp_install.sh
	utils/llama_cpp_install.sh $(BIN)/python
	touch $@

llama-cpp: $(LLAMA_CPP)

# The native runtime runs without torch_xla, under a torch TorchTPU accepts: a venv of its own,
# the project installed from its `native` extra (a GPU machine: `pip install -e '.[gpu]'` into
# the environment of its own torch, which is kept).
$(NATIVE_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV_NATIVE)
	$(VENV_NATIVE)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_NATIVE)/bin/python -m pip install --quiet torch==$(NATIVE_TORCH) -e '.[native]' 'pytest>=8' $(XDIST)
	touch $@

setup-native: $(NATIVE_STAMP)

test-native: $(NATIVE_STAMP)
	PYTHONPATH=$(CURDIR) TPU_LORA_NATIVE_ENV=1 $(VENV_NATIVE)/bin/python -m pytest $(PARALLEL) -m native $(NATIVE_TESTS)

# The tests of GGUF files fail, rather than skip, when llama.cpp is missing here.
test: $(STAMP) $(LLAMA_CPP)
	PJRT_DEVICE=CPU REQUIRE_LLAMA_CPP=1 $(BIN)/python -m pytest $(PARALLEL) -m "not (native and slow)" --durations=25

test-fast: $(STAMP) $(LLAMA_CPP)
	PJRT_DEVICE=CPU REQUIRE_LLAMA_CPP=1 $(BIN)/python -m pytest $(PARALLEL) -m "not slow and not heavy"

lint: $(STAMP)
	$(BIN)/ruff check .

tiny-model: $(STAMP)
	$(BIN)/python -m finetuning_pipeline.demo.tiny_model --out $(DEMO)/base --force

# The recipe of each input lives in finetuning_pipeline/demo/inputs.py (main.py without --config
# builds what is missing with it too); these rules rebuild what is out of date.
$(DEMO_BASE): $(STAMP) $(SAMPLES)/domain_text.jsonl $(SAMPLES)/chat_qa.jsonl $(SAMPLES)/alpaca.jsonl \
		finetuning_pipeline/demo/tiny_model.py finetuning_pipeline/demo/tiny_pretraining.py
	$(BIN)/python -m finetuning_pipeline.demo.inputs base --force

$(DEMO)/data/phase1/manifest.json: $(DEMO_BASE) $(SAMPLES)/domain_text.jsonl
	$(BIN)/python -m finetuning_pipeline.demo.inputs phase1 --force

$(DEMO)/data/phase2/manifest.json: $(DEMO_BASE) $(SAMPLES)/chat_qa.jsonl $(SAMPLES)/alpaca.jsonl
	$(BIN)/python -m finetuning_pipeline.demo.inputs phase2 --force

$(DEMO)/data/phase3/manifest.json: $(DEMO_BASE) $(SAMPLES)/preference.jsonl
	$(BIN)/python -m finetuning_pipeline.demo.inputs phase3 --force

demo-data: $(DEMO_DATA)

demo: $(DEMO_DATA)
	$(BIN)/python finetuning_pipeline/main.py --config $(DEMO_CONFIG) --resume never --force $(ARGS)
	$(BIN)/python -m finetuning_pipeline.export --base $(DEMO)/base --adapter $(DEMO_RUN)/phase3/adapter --out $(DEMO_RUN)/merged --force
	@echo "--- a question from the bundled chat data: $(DEMO_QUESTION)"
	@echo "    (its answer there: $(DEMO_ANSWER))"
	@set -e; \
	before=$$($(BIN)/python -m finetuning_pipeline.generate --model $(DEMO)/base --prompt "$(DEMO_QUESTION)"); \
	after=$$($(BIN)/python -m finetuning_pipeline.generate --model $(DEMO_RUN)/merged --prompt "$(DEMO_QUESTION)"); \
	echo "base model (pretrained on the domain text): $$before"; \
	echo "after phases 1, 2 and 3 (merged model):    $$after"
	$(BIN)/python -m finetuning_pipeline.export --format gguf --outtype q8_0 --base $(DEMO)/base \
		--adapter $(DEMO_RUN)/phase3/adapter --out $(DEMO_RUN)/merged-q8_0.gguf --force
	@set -e; \
	if $(BIN)/python -c "import llama_cpp" 2>/dev/null; then \
		answer=$$($(BIN)/python -m finetuning_pipeline.generate --model $(DEMO_RUN)/merged-q8_0.gguf --prompt "$(DEMO_QUESTION)"); \
		echo "llama.cpp on the Q8_0 GGUF:                $$answer"; \
	else \
		echo "(llama.cpp is not installed here: make llama-cpp, then make demo again, asks the GGUF the same question)"; \
	fi
	@echo "--- outputs in $(DEMO_RUN)/: phase1/ phase2/ phase3/ (adapter, checkpoints, metrics.jsonl, summary.json), merged/,"
	@echo "    merged-q8_0.gguf (llama.cpp, Ollama, LM Studio), loss.png"

# phase1, phase2, phase3, ...: that phase of CONFIG's curriculum.
phase%: $(STAMP) $(PHASE_DEPS)
	$(BIN)/python finetuning_pipeline/main.py --config $(CONFIG) --phase $* $(ARGS)

preflight: $(STAMP) $(PHASE_DEPS)
	$(BIN)/python -m finetuning_pipeline.preflight --config $(CONFIG) $(ARGS)

tpu-check: $(STAMP) $(PHASE_DEPS)
	$(BIN)/python -m finetuning_pipeline.tpu_check --config $(CONFIG) $(ARGS)

bench: bench-train bench-host bench-lora-cost bench-prepare bench-memory bench-side-by-side bench-quantized bench-quantized-load \
	bench-gguf-export bench-stop bench-preference bench-embeddings

bench-train: $(STAMP)
	$(BIN)/python -m benchmarks.train_bench

bench-host: $(STAMP)
	$(BIN)/python -m benchmarks.host_bench

bench-lora-cost: $(STAMP)
	$(BIN)/python -m benchmarks.lora_cost_bench

bench-prepare: $(STAMP)
	$(BIN)/python -m benchmarks.prepare_throughput

bench-memory: $(STAMP)
	$(BIN)/python -m benchmarks.memory_bench

bench-side-by-side: $(STAMP)
	$(BIN)/python -m benchmarks.side_by_side_bench

bench-quantized: $(STAMP)
	$(BIN)/python -m benchmarks.quantized_bench

bench-quantized-load: $(STAMP)
	$(BIN)/python -m benchmarks.quantized_load_bench

bench-gguf-export: $(STAMP)
	$(BIN)/python -m benchmarks.gguf_export_bench

bench-stop: $(STAMP)
	$(BIN)/python -m benchmarks.stop_latency_bench

bench-preference: $(STAMP)
	$(BIN)/python -m benchmarks.preference_bench

bench-embeddings: $(STAMP)
	$(BIN)/python -m benchmarks.embeddings_bench

clean:
	rm -rf outputs .pytest_cache
	find . -name __pycache__ -not -path './$(VENV)/*' -prune -exec rm -rf {} +
