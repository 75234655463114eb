#!/usr/bin/env bash
# Set up the environment (if needed) and run the whole test suite on CPU.
#     bash tests/run.sh [pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source launch/setup_env.sh requirements-dev.txt
export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONUNBUFFERED=1
exec python -m pytest -q -p no:cacheprovider --durations=15 "$@" tests
