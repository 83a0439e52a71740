#!/usr/bin/env bash
# cloud-clone-public.sh for a private repository: the same sparse clone, install and TPU
# check, authenticated with a GitHub token read from an environment variable.
#
#   GITHUB_TOKEN=... utils/tpu_vm/cloud-clone-private.sh --repo https://github.com/OWNER/REPO.git \
#       [--token-env GITHUB_TOKEN] [--branch main] [--dir ~/lora-tpu] [--dry-run]
#
# The token (a fine-grained token with read access to the repository's contents) is passed to
# git through an in-memory credential helper for the clone only: it is never printed, never
# written to .git/config, and not part of any command line that `ps` could show.
set -euo pipefail
HERE=$(dirname "${BASH_SOURCE[0]}")
# shellcheck source-path=SCRIPTDIR source=tpu_vm_lib.sh
source "$HERE/tpu_vm_lib.sh"

TOKEN_ENV=GITHUB_TOKEN REPO="" PASS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --token-env) need_value "$1" "${2:-}"; TOKEN_ENV=$2; shift 2 ;;
    --repo) need_value "$1" "${2:-}"; REPO=$2; PASS+=("$1" "$2"); shift 2 ;;
    --dry-run) DRY_RUN=1; PASS+=("$1"); shift ;;
    -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) PASS+=("$1"); shift ;;  # the public script's options; it checks them
  esac
done
[[ -n "$REPO" ]] || die "--repo is required (the https URL of the repository)"
[[ "$REPO" == https://* ]] || die "--repo must be an https URL (the token authenticates https)"
if [[ -z "${!TOKEN_ENV:-}" && "$DRY_RUN" != 1 ]]; then
  die "\$$TOKEN_ENV is empty: export a GitHub token with read access to $REPO (or name another variable with --token-env)"
fi

# git asks this helper for credentials; it answers from the environment variable, by name,
# so the token itself never appears in an argument list.
export GIT_TOKEN_VARIABLE=$TOKEN_ENV
# shellcheck disable=SC2016  # expanded by the helper's shell, at credential time
HELPER='!f() { echo username=x-access-token; echo "password=$(printenv "$GIT_TOKEN_VARIABLE")"; }; f'
git() { command git -c credential.helper= -c "credential.helper=$HELPER" "$@"; }

# The public script, in this shell: its git calls reach the function above.
# shellcheck source-path=SCRIPTDIR source=cloud-clone-public.sh
source "$HERE/cloud-clone-public.sh" "${PASS[@]}"
