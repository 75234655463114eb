#!/usr/bin/env bash
# Prepare the Python environment in .venv (idempotent; a re-run with unchanged requirements is a
# no-op). Sourced by launch/quickstart.sh and tests/run.sh, or run by hand:
#     bash launch/setup_env.sh [requirements-dev.txt]
# Environment: ADMIN_DS_VENV (default: <repo>/.venv), PYTHON (default: python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ADMIN_DS_VENV:-$ROOT/.venv}"
REQS="${1:-requirements.txt}"
PY="${PYTHON:-python3}"

# apt takes its locks without waiting, so another apt run (unattended upgrades at boot, a second
# setup on the node) would fail this one at once. It waits up to APT_LOCK_WAIT seconds instead:
# DPkg::Lock::Timeout covers dpkg's lock (install); the package lists' lock (update) has no such
# option in apt 2.6, so update is retried while the lock is what stops it.
APT_LOCK_WAIT="${APT_LOCK_WAIT:-300}"
apt_get() {
  local waited=0 out
  until out="$(apt-get -o DPkg::Lock::Timeout="$APT_LOCK_WAIT" "$@" 2>&1)"; do
    if ! grep -q "Could not get lock" <<<"$out" || [ "$waited" -ge "$APT_LOCK_WAIT" ]; then
      echo "$out" >&2
      return 1
    fi
    [ "$waited" = 0 ] && echo "[setup] another apt or dpkg holds its lock; waiting up to ${APT_LOCK_WAIT}s" >&2
    sleep 5
    waited=$((waited + 5))
  done
}

# OpenMPI serves the MPI launch paths (mpirun / deepspeed --launcher openmpi). Install it from the
# OS packages when we may; otherwise say what is missing and carry on: nothing else needs it.
if ! command -v mpirun >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing OpenMPI from the OS packages (openmpi-bin, libopenmpi-dev)"
    apt_get update -qq
    DEBIAN_FRONTEND=noninteractive apt_get install -y -qq openmpi-bin libopenmpi-dev
  else
    echo "[setup] note: OpenMPI (mpirun) not found and not installable here (not root, or no apt-get)." >&2
    echo "[setup]       Install it for MPI launches, e.g. 'sudo apt-get install openmpi-bin libopenmpi-dev'." >&2
  fi
fi

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "[setup] error: $PY is missing or older than Python 3.10" >&2
  exit 1
fi
# An interrupted creation leaves bin/python without bin/activate (venv writes the scripts last),
# and pip would then install into whatever python comes first on PATH: made again.
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/bin/activate" ]; then
  "$PY" -m venv --clear "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

stamp="$VENV/.admin_ds_requirements"
want="$(cd "$ROOT" && cat requirements.txt "$REQS" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing Python packages into $VENV"
  python -m pip install -q --upgrade pip
  python -m pip install -q "$(grep -E '^torch==' "$ROOT/requirements.txt")"
  python -m pip install -q -r "$ROOT/$REQS"
  echo "$want" > "$stamp"
fi
# The package itself, editable: `import admin_ds` works from any directory and every launcher.
# The check runs from / so that the repository on the current path cannot answer for the install.
if ! (cd / && python -c 'import admin_ds, sys; sys.exit(not admin_ds.__file__.startswith(sys.argv[1]))' "$ROOT") 2>/dev/null; then
  python -m pip install -q --no-deps -e "$ROOT"
fi
