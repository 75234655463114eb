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

# OpenMPI serves the MPI launch paths (mpirun / deepspeed --launcher openmpi). Install it from the
# OS packages when we may; otherwise say what is missing and carry on: nothing else needs it.
if ! command -v mpirun >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing OpenMPI from the OS packages (openmpi-bin, libopenmpi-dev)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
  else
    echo "[setup] note: OpenMPI (mpirun) not found and not installable here (not root, or no apt-get)." >&2
    echo "[setup]       Install it for MPI launches, e.g. 'sudo apt-get install openmpi-bin libopenmpi-dev'." >&2
  fi
fi

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "[setup] error: $PY is missing or older than Python 3.10" >&2
  exit 1
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
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
