#!/usr/bin/env bash
# Create a Cloud TPU VM, wait until it is READY, and ssh into it; optionally delete it on exit.
#
#   utils/tpu_vm/gcloud_tpuvm.sh --name my-tpu --type v5litepod-8 --zone us-west4-a \
#       [--version v2-alpha-tpuv5-lite] [--any-version] [--spot] [--project P]
#       [--cache-disk DISK] [--delete-on-exit] [--no-ssh] [--dry-run]
#
# --version (the TPU software image) defaults to the one Google lists for PyTorch on the type's
# generation; another one is refused before create (a v6e on the base image fails only after
# create and install), unless --any-version is given.
# --spot asks for a spot (preemptible) VM: a fraction of the price, but Google may stop it at
# any time; the trainer checkpoints on the preemption signal and `--resume auto` continues.
# --cache-disk attaches the persistent disk DISK read-write (make it once: gcloud compute disks
# create DISK --size 50GB --type pd-balanced --zone Z): it outlives the VM, so XLA's compile
# cache on it survives preemption; on the VM, mount-cache-disk.sh mounts it (single-host VMs).
# --delete-on-exit deletes the VM when this script exits (after the ssh session, or on an
# error or Ctrl-C), so an idle VM never keeps billing. --dry-run prints the gcloud commands.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=tpu_vm_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/tpu_vm_lib.sh"

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }

NAME="" TYPE="" ZONE="" VERSION="" PROJECT="" CACHE_DISK="" SPOT=0 DELETE_ON_EXIT=0 SSH=1 ANY_VERSION=0
READY_TIMEOUT=${READY_TIMEOUT:-900} POLL_SECONDS=${POLL_SECONDS:-10}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) need_value "$1" "${2:-}"; NAME=$2; shift 2 ;;
    --type) need_value "$1" "${2:-}"; TYPE=$2; shift 2 ;;
    --zone) need_value "$1" "${2:-}"; ZONE=$2; shift 2 ;;
    --version) need_value "$1" "${2:-}"; VERSION=$2; shift 2 ;;
    --project) need_value "$1" "${2:-}"; PROJECT=$2; shift 2 ;;
    --cache-disk) need_value "$1" "${2:-}"; CACHE_DISK=$2; shift 2 ;;
    --any-version) ANY_VERSION=1; shift ;;
    --spot) SPOT=1; shift ;;
    --delete-on-exit) DELETE_ON_EXIT=1; shift ;;
    --no-ssh) SSH=0; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done
[[ -n "$NAME" ]] || die "--name is required"
[[ -n "$TYPE" ]] || die "--type is required (an accelerator type, e.g. v5litepod-8, v6e-8, v4-8)"
[[ -n "$ZONE" ]] || die "--zone is required (a zone that offers --type, e.g. us-west4-a)"
EXPECTED=$(runtime_for "$TYPE")
if [[ -z "$VERSION" ]]; then
  [[ -n "$EXPECTED" ]] || die "--version is required for --type $TYPE (its generation is not in this script's table; see https://cloud.google.com/tpu/docs/runtimes)"
  VERSION=$EXPECTED
elif [[ -n "$EXPECTED" && "$VERSION" != "$EXPECTED" && "$ANY_VERSION" != 1 ]]; then
  die "--version $VERSION does not match --type $TYPE, whose generation runs PyTorch on $EXPECTED (https://cloud.google.com/tpu/docs/runtimes); on another image the VM fails only after create and install (\"Failed to get global TPU topology\"). Leave --version out, or add --any-version to keep $VERSION"
fi

gcloud_scope "$ZONE" "$PROJECT"

delete_vm() {
  run gcloud compute tpus tpu-vm delete "$NAME" "${SCOPE[@]}" --quiet
}

CREATE=(gcloud compute tpus tpu-vm create "$NAME" "${SCOPE[@]}" --accelerator-type "$TYPE" --version "$VERSION")
[[ "$SPOT" != 1 ]] || CREATE+=(--spot)
if [[ -n "$CACHE_DISK" ]]; then
  disk_project=${PROJECT:-$(gcloud config get-value project 2>/dev/null || true)}
  [[ -n "$disk_project" ]] || die "--cache-disk needs --project (or: gcloud config set project P)"
  CREATE+=(--data-disk "source=projects/$disk_project/zones/$ZONE/disks/$CACHE_DISK,mode=read-write")
fi
if [[ "$DELETE_ON_EXIT" == 1 ]]; then
  trap delete_vm EXIT
fi
run "${CREATE[@]}"

echo "waiting for $NAME to be READY (up to ${READY_TIMEOUT}s)"
if [[ "$DRY_RUN" == 1 ]]; then
  run gcloud compute tpus tpu-vm describe "$NAME" "${SCOPE[@]}" --format 'value(state)'
else
  waited=0
  while true; do
    state=$(gcloud compute tpus tpu-vm describe "$NAME" "${SCOPE[@]}" --format 'value(state)')
    [[ "$state" == READY ]] && break
    case "$state" in
      PREEMPTED|TERMINATED|FAILED|STOPPED) die "$NAME is $state, not READY" ;;
    esac
    (( waited >= READY_TIMEOUT )) && die "$NAME not READY after ${READY_TIMEOUT}s (state: ${state:-unknown})"
    sleep "$POLL_SECONDS"
    waited=$(( waited + POLL_SECONDS ))
  done
fi
echo "$NAME is READY"

if [[ "$SSH" == 1 ]]; then
  # Not exec: the EXIT trap must still run to delete the VM after the session.
  run gcloud compute tpus tpu-vm ssh "$NAME" "${SCOPE[@]}" --worker 0
fi
