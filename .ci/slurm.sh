#!/usr/bin/env bash
# Local Slurm for the cluster test suite (tests/cluster/, marker `cluster`).
#
#   .ci/slurm.sh install   install slurmctld, slurmd, the client tools and munge (Debian/Ubuntu)
#   .ci/slurm.sh check     report whether everything the tests need is on PATH
#
# The cluster itself is started and stopped by the tests (tests/cluster/slurm.py writes a
# slurm.conf into a temp dir); this script only provides the packages. A failed install is
# reported, not fatal: the cluster tests then skip with the reason.
set -u

need=(munged slurmctld slurmd sbatch srun sinfo scontrol)

check() {
  local missing=()
  for cmd in "${need[@]}"; do
    command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing+=("$cmd")
  done
  if [ ${#missing[@]} -eq 0 ]; then
    echo "slurm: all of ${need[*]} found"
    return 0
  fi
  echo "slurm: missing ${missing[*]} (run: .ci/slurm.sh install)"
  return 1
}

install() {
  if check >/dev/null 2>&1; then
    check
    return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "slurm: apt-get not found; install slurmctld slurmd slurm-client munge with your" \
      "package manager. The cluster tests will skip."
    return 0
  fi
  if [ "$(id -u)" -ne 0 ]; then
    echo "slurm: installing packages needs root; the cluster tests will skip."
    return 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get update; then
    echo "slurm: apt-get update failed (no network?); the cluster tests will skip."
    return 0
  fi
  if ! apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge; then
    echo "slurm: apt-get install failed; the cluster tests will skip."
    return 0
  fi
  check || true
}

case "${1:-}" in
  install) install ;;
  check) check ;;
  *)
    echo "usage: $0 install|check" >&2
    exit 2
    ;;
esac
