#!/usr/bin/env bash
# Set up the environment (if needed) and run the whole test suite on CPU.
#     bash tests/run.sh [pytest args]      (TEST_WORKERS=0 bash tests/run.sh: one process)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source launch/setup_env.sh requirements-dev.txt
export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONUNBUFFERED=1
# Test files run side by side in pytest-xdist workers, one per core (at most 8; TEST_WORKERS=N sets
# the number, 0 runs everything in this process). A file's tests stay in one worker, so what they
# share (a prepared corpus, a finished run) is made once.
cores="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"  # nproc itself would obey OMP_NUM_THREADS
workers="${TEST_WORKERS:-$(( cores < 8 ? cores : 8 ))}"
exec python -m pytest -q -p no:cacheprovider --durations=15 -n "$workers" --dist loadfile "$@" tests
