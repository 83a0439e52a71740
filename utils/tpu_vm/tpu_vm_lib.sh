#!/usr/bin/env bash
# Shared by the TPU VM scripts in utils/tpu_vm/ (sourced, not run): dry-run aware command runner,
# argument helpers, and the repository set-up that cloud-clone-public.sh and
# cloud-clone-private.sh both perform.

DRY_RUN=${DRY_RUN:-0}

die() {
  echo "error: $*" >&2
  exit 2
}

# run CMD ARGS...: print the command (shell-quoted), then run it unless --dry-run was given.
run() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  if [[ "$DRY_RUN" != 1 ]]; then
    "$@"
  fi
}

# gcloud_scope ZONE [PROJECT]: the --zone/--project arguments of every tpu-vm command, in SCOPE.
gcloud_scope() {
  SCOPE=(--zone "$1")
  [[ -z "${2:-}" ]] || SCOPE+=(--project "$2")
}

# runtime_for TYPE: the TPU software version Google lists for PyTorch on TYPE's generation
# (https://cloud.google.com/tpu/docs/runtimes); nothing for a generation not listed here.
runtime_for() {
  case "$1" in
    v6e-*) echo v2-alpha-tpuv6e ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v5litepod-*|v5e-*) echo v2-alpha-tpuv5-lite ;;
    v2-*|v3-*|v4-*) echo tpu-ubuntu2204-base ;;
  esac
}

# need_value OPTION VALUE: an option that takes a value got one.
need_value() {
  [[ -n "${2:-}" && "${2:0:2}" != "--" ]] || die "$1 needs a value (see --help)"
}

# The torch that torch_xla 2.9.0 needs exactly (pyproject.toml pins both).
TORCH_VERSION=2.9.0
# What a TPU run needs of the repository; top-level files (pyproject.toml, Makefile) come
# with any sparse checkout in cone mode.
SPARSE_PATHS=(lora_logic dataset finetuning_pipeline utils)

# sparse_clone URL DIR BRANCH: a blobless, sparse clone; an existing clone is updated instead.
sparse_clone() {
  local url=$1 dir=$2 branch=$3
  if [[ -d "$dir/.git" ]]; then
    run git -C "$dir" fetch --filter=blob:none origin "$branch"
    run git -C "$dir" checkout --force FETCH_HEAD
  else
    run git clone --filter=blob:none --sparse --branch "$branch" "$url" "$dir"
  fi
  run git -C "$dir" sparse-checkout set "${SPARSE_PATHS[@]}"
}

# PyPI's torch wheel for x86-64 is the CUDA build (several GB of CUDA libraries, unused on a
# TPU); this index has the CPU build of the same version (2.9.0+cpu satisfies torch==2.9.0).
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

# The Python of the project's venv on the VM. torch_xla[pallas] pins jax 0.7.1, which needs
# Python >= 3.11, and the Ubuntu 22.04 TPU images' python3 is 3.10: uv (pinned) brings this
# version (a standalone build) for the venv; the image's python3 only runs uv.
VENV_PYTHON=3.11
UV_VERSION=0.13.9

# install_stack DIR: DIR/.venv with Python $VENV_PYTHON, the CPU build of torch, then the project
# with its tpu extra, which brings torch_xla[tpu,pallas] (libtpu, and the jax + jaxlib the Pallas
# kernels need, as torch_xla pins them). The venv is marked as the TPU's (.venv/.tpu) and stamped
# installed (.venv/.installed): every make target then runs in it, and a changed pyproject.toml
# updates its tpu extra (Makefile). A .venv that this script did not make is left alone.
install_stack() {
  local dir=$1 python=${PYTHON:-python3} venv=$1/.venv
  if [[ -e "$venv" && ! -e "$venv/.tpu" ]]; then
    die "$venv exists and is not this script's TPU install; move it away (or delete it) and run again"
  fi
  run "$python" -m pip install --user --upgrade "uv==$UV_VERSION"
  if [[ ! -e "$venv/.tpu" ]]; then
    run "$python" -m uv venv --seed --python "$VENV_PYTHON" "$venv"  # --seed: pip, which make's targets use
  fi
  run "$venv/bin/python" -m pip install "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
  run "$venv/bin/python" -m pip install -e "${dir}[tpu]"
  run touch "$venv/.tpu" "$venv/.installed"
}

# install_native_stack DIR: the native runtime's install (runtime.backend=native runtime.device=tpu),
# beside the XLA one: DIR/.venv-native with Python $VENV_PYTHON (TorchTPU needs 3.11 or newer),
# the CPU build of torch $NATIVE_TORCH_VERSION (TorchTPU's range: 2.11 to 2.15), then the project
# with its tpu-native extra (torch-tpu, which brings its libtpu; no torch_xla), which keeps that
# torch. Marked and stamped as install_stack's venv is; one this script did not make is left alone.
NATIVE_TORCH_VERSION=2.13.0
install_native_stack() {
  local dir=$1 python=${PYTHON:-python3} venv=$1/.venv-native
  if [[ -e "$venv" && ! -e "$venv/.tpu" ]]; then
    die "$venv exists and is not this script's TPU install; move it away (or delete it) and run again"
  fi
  run "$python" -m pip install --user --upgrade "uv==$UV_VERSION"
  if [[ ! -e "$venv/.tpu" ]]; then
    run "$python" -m uv venv --seed --python "$VENV_PYTHON" "$venv"
  fi
  run "$venv/bin/python" -m pip install "torch==$NATIVE_TORCH_VERSION" --index-url "$TORCH_CPU_INDEX"
  run "$venv/bin/python" -m pip install -e "${dir}[tpu-native]"
  run touch "$venv/.tpu" "$venv/.installed"
}

# verify_native_tpu DIR: TorchTPU sees the TPU chips in DIR's native venv.
verify_native_tpu() {
  local python=$1/.venv-native/bin/python
  run "$python" -c '
import torch, torch_tpu
count = torch.tpu.device_count() if torch.tpu.is_available() else 0
print(f"TorchTPU sees {count} TPU device(s) (torch {torch.__version__})")
raise SystemExit(0 if count > 0 else 1)' || die "no TPU device is visible to TorchTPU (is this a TPU VM? is another process holding the TPU?)"
}

# verify_tpu DIR: the TPU chips are visible to torch_xla in DIR's venv (fails with a clear message if not).
verify_tpu() {
  local python=$1/.venv/bin/python
  run env PJRT_DEVICE=TPU "$python" -c '
import torch_xla, torch_xla.runtime as xr
count = xr.global_runtime_device_count()
print(f"torch_xla sees {count} TPU device(s): {torch_xla.device()}")
raise SystemExit(0 if count > 0 else 1)' || die "no TPU device is visible to torch_xla (is this a TPU VM? is another process holding the TPU?)"
}
