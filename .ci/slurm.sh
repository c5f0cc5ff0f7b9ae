#!/usr/bin/env bash
# Local Slurm for the cluster test suite (tests/cluster/, marker `cluster`).
#
#   .ci/slurm.sh install   install slurmctld, slurmd, the client tools and munge (Debian/Ubuntu)
#   .ci/slurm.sh check     report whether everything the tests need is on PATH
#
# The cluster itself is started and stopped by the tests (tests/cluster/slurm.py writes a
# slurm.conf into a temp dir); this script only provides the packages. Each command exits 1 with
# the reason when Slurm is not there afterwards: CI requires the cluster tests (LOWBIT_REQUIRE in
# .ci/run), so a failed install must stop it rather than let them skip.
set -u

need=(munged slurmctld slurmd sbatch srun sinfo scontrol scancel)

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
      "package manager." >&2
    return 1
  fi
  if [ "$(id -u)" -ne 0 ]; then
    echo "slurm: installing packages needs root; run .ci/slurm.sh install as root." >&2
    return 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get update; then
    echo "slurm: apt-get update failed (no network?)." >&2
    return 1
  fi
  if ! apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge; then
    echo "slurm: apt-get install failed." >&2
    return 1
  fi
  check
}

case "${1:-}" in
  install) install ;;
  check) check ;;
  *)
    echo "usage: $0 install|check" >&2
    exit 2
    ;;
esac
