#!/usr/bin/env bash
# Prepare WMT14 En-De / En-Fr for training: a thin wrapper around data_prep/prepare.py.
#     bash data_prep/prepare_wmt14.sh {en-de|en-fr} OUT_DIR [options]     (--help for all options)
# Uses the repository's .venv when there is one, else python3; needs no installation of admin_ds.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/python_env.sh"
export DATA_PREP_ARGV0="bash data_prep/prepare_wmt14.sh"
exec "$PYTHON" -m data_prep.prepare "$@"
