#!/usr/bin/env bash
# Run one command on every worker (host) of a TPU pod slice at once, from your machine.
#
#   utils/tpu_vm/run-on-pod.sh --name my-pod --zone us-central2-b [--project P] [--dir lora-tpu] [--dry-run] -- COMMAND...
#
# Multi-host training is the same command on every worker: e.g.
#   utils/tpu_vm/run-on-pod.sh --name my-pod --zone Z -- PJRT_DEVICE=TPU .venv/bin/python finetuning_pipeline/main.py \
#       --config finetuning_pipeline/configs/mistral7b_v6e8.yaml parallel.mode=fsdp
# The command runs in --dir (default lora-tpu in the home directory: where cloud-clone-*.sh put it).
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=tpu_vm_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/tpu_vm_lib.sh"

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }

NAME="" ZONE="" PROJECT="" DIR=lora-tpu  # relative to the home directory the ssh session starts in
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) need_value "$1" "${2:-}"; NAME=$2; shift 2 ;;
    --zone) need_value "$1" "${2:-}"; ZONE=$2; shift 2 ;;
    --project) need_value "$1" "${2:-}"; PROJECT=$2; shift 2 ;;
    --dir) need_value "$1" "${2:-}"; DIR=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) die "unknown argument: $1 (put the command after --; see --help)" ;;
  esac
done
[[ -n "$NAME" ]] || die "--name is required (the TPU VM / pod slice name)"
[[ -n "$ZONE" ]] || die "--zone is required"
[[ $# -gt 0 ]] || die "no command given (put it after --)"

# The remote shell gets one string: the words of COMMAND, each quoted, so arguments with
# spaces arrive as they were given here; `cd` first (--dir unquoted, so ~ and $HOME expand there).
printf -v remote '%q ' "$@"
remote="cd $DIR && ${remote% }"
gcloud_scope "$ZONE" "$PROJECT"
run gcloud compute tpus tpu-vm ssh "$NAME" "${SCOPE[@]}" --worker all --command "$remote"
