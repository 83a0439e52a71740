#!/usr/bin/env bash
# On a TPU VM: mount the persistent disk attached with gcloud_tpuvm.sh --cache-disk, formatting
# it the first time only, and make the XLA compile cache directory on it.
#
#   bash mount-cache-disk.sh [--device /dev/disk/by-id/google-persistent-disk-1]
#       [--mount-point /mnt/disks/persist] [--dry-run]
#
# Then train with xla.compile_cache_dir=MOUNT_POINT/xla-cache: a preempted spot VM's
# replacement, given the same disk, loads the compiled graphs instead of compiling them again.
# A disk that already holds a filesystem is never formatted.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=tpu_vm_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/tpu_vm_lib.sh"

usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }

DEVICE=/dev/disk/by-id/google-persistent-disk-1 MOUNT_POINT=/mnt/disks/persist
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) need_value "$1" "${2:-}"; DEVICE=$2; shift 2 ;;
    --mount-point) need_value "$1" "${2:-}"; MOUNT_POINT=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
done
[[ "$DRY_RUN" == 1 || -e "$DEVICE" ]] || die "$DEVICE: no such disk; create the VM with gcloud_tpuvm.sh --cache-disk DISK"

# blkid exits 0 when the device holds a filesystem and 2 when it holds none: only then is it
# formatted; any other answer (no permission, an I/O error) stops here. (A dry run probes
# nothing and prints the format command it would run on an empty disk.)
probe=2
[[ "$DRY_RUN" == 1 ]] || { sudo blkid "$DEVICE" >/dev/null && probe=0 || probe=$?; }
case "$probe" in
  0) echo "$DEVICE already holds a filesystem: mounting it as it is" ;;
  2) run sudo mkfs.ext4 -m 0 -E lazy_itable_init=0,lazy_journal_init=0,discard "$DEVICE" ;;
  *) die "blkid $DEVICE failed (exit $probe): cannot tell whether it holds a filesystem, so it is not formatted" ;;
esac
run sudo mkdir -p "$MOUNT_POINT"
if [[ "$DRY_RUN" != 1 ]] && mountpoint -q "$MOUNT_POINT"; then
  echo "$MOUNT_POINT is already mounted"
else
  run sudo mount -o discard,defaults "$DEVICE" "$MOUNT_POINT"
fi
run sudo mkdir -p "$MOUNT_POINT/xla-cache"
run sudo chmod a+w "$MOUNT_POINT/xla-cache"
echo "compile cache ready: train with xla.compile_cache_dir=$MOUNT_POINT/xla-cache"
