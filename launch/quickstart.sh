#!/usr/bin/env bash
# The main job on a fresh machine: set up .venv (once), then train the embedded default with
# DeepSpeed ZeRO-2: generated corpus -> SentencePiece -> binarized data -> distributed Admin
# profiling -> training -> checkpoints -> beam search on the held-out split -> BLEU.
#     bash launch/quickstart.sh [--section.key=value ...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source launch/setup_env.sh requirements.txt  # not "$@": those are the training overrides
if ! python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
fi
exec deepspeed launch/train.py --deepspeed_config ds_configs/zero2.json "$@"
