#!/usr/bin/env bash
# On a TPU VM: sparse-clone this repository, install into its .venv (Python 3.11, made by uv) torch 2.9
# (CPU build) + torch_xla[tpu,pallas] 2.9 and the project, and check that torch_xla sees the TPU chips.
# --runtime native: into .venv-native instead, torch 2.13 + TorchTPU (torch-tpu) and no torch_xla.
#
#   utils/tpu_vm/cloud-clone-public.sh --repo https://github.com/OWNER/REPO.git [--branch main] [--dir ~/lora-tpu] [--runtime xla|native] [--dry-run]
#
# Run it on every worker of a pod slice at once with utils/tpu_vm/run-on-pod.sh. PYTHON picks the
# interpreter that runs uv (default python3); --dry-run prints the commands without running them.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=tpu_vm_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/tpu_vm_lib.sh"

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }

REPO="" BRANCH=main DIR="$HOME/lora-tpu" RUNTIME=xla
while [[ $# -gt 0 ]]; do
  case "$1" in
    --repo) need_value "$1" "${2:-}"; REPO=$2; shift 2 ;;
    --branch) need_value "$1" "${2:-}"; BRANCH=$2; shift 2 ;;
    --dir) need_value "$1" "${2:-}"; DIR=$2; shift 2 ;;
    --runtime) need_value "$1" "${2:-}"; RUNTIME=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done
[[ -n "$REPO" ]] || die "--repo is required (the https URL of the repository)"
[[ "$RUNTIME" == xla || "$RUNTIME" == native ]] || die "--runtime must be xla or native (got $RUNTIME)"

sparse_clone "$REPO" "$DIR" "$BRANCH"
if [[ "$RUNTIME" == native ]]; then
  install_native_stack "$DIR"
  verify_native_tpu "$DIR"
  echo "ready: cd $DIR && .venv-native/bin/python finetuning_pipeline/main.py --config CONFIG runtime.backend=native runtime.device=tpu"
else
  install_stack "$DIR"
  verify_tpu "$DIR"
  echo "ready: cd $DIR && PJRT_DEVICE=TPU make tpu-check CONFIG=CONFIG, then PJRT_DEVICE=TPU .venv/bin/python finetuning_pipeline/main.py --config CONFIG"
fi
