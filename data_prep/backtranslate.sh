#!/usr/bin/env bash
# Back-translation: a reverse model translates target-language monolingual text; the synthetic
# pairs are filtered, optionally tagged with <BT>, and combined with the bitext into a data dir.
#     bash data_prep/backtranslate.sh --model REVERSE --mono FILE... --out DIR --bitext DATA_DIR [options]
# Several ranks: torchrun --nproc_per_node K -m data_prep.backtranslate ... (PYTHONPATH=repo root).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/python_env.sh"
export DATA_PREP_ARGV0="bash data_prep/backtranslate.sh"
exec "$PYTHON" -m data_prep.backtranslate "$@"
