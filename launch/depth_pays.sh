#!/usr/bin/env bash
# Does depth pay? Admin Transformers of one width (the Multi30k recipe's 256/1024/4) at several
# depths on Multi30k en-de, each trained until its validation loss stops improving
# (train.patience), its checkpoints of lowest validation loss averaged (train.keep_best: the last
# ones come after the best), test2016 decoded with beam 4, and every pair of
# models compared by sacreBLEU's paired bootstrap (docs/results.md); the runs' curves
# side by side in OUT/curves.png.
#
#   bash launch/depth_pays.sh RAW_DIR [OUT] [DEPTH ...]     # DEPTH: E-D layers, default 6-6 18-18 60-12
#   INIT=pre bash launch/depth_pays.sh RAW_DIR runs/depth 18-18   # Pre-LN with the same recipe
#
# RAW_DIR holds Multi30k's train/val/test_2016_flickr .{en,de}.gz (docs/recipes/multi30k.md).
# Every step resumes: after an interruption the same command continues each run from its newest
# checkpoint and redoes only what is missing. Models of 60 layers or more train as 2 pipeline
# stages on 2 ranks, the others in one process (both with DS_CONFIG).
# Environment: INIT (admin, post or pre), MAX_UPDATES (8000), PATIENCE (validations, 5),
# VALID_EVERY (updates, 160), AVERAGE (checkpoints of lowest validation loss averaged, 5), DS_CONFIG (the engine config,
# ds_configs/zero1.json; ds_configs/zero1_bf16.json trains 1.6-2x faster on a CPU with AMX, e.g. Intel
# Sapphire Rapids, 1.3-1.4x on an AMD EPYC with AVX-512 BF16, or on a bf16 GPU: BENCHMARKS.md; in bf16 on
# a CPU, preload tcmalloc as well: docs/training.md).
set -euo pipefail
cd "$(dirname "$0")/.."
RAW=${1:?usage: bash launch/depth_pays.sh RAW_DIR [OUT] [DEPTH ...]}
OUT=${2:-runs/depth}
shift $(( $# < 2 ? $# : 2 ))
[ $# -gt 0 ] && DEPTHS=("$@") || read -r -a DEPTHS <<< "6-6 18-18 60-12"
INIT=${INIT:-admin}
MAX_UPDATES=${MAX_UPDATES:-8000} PATIENCE=${PATIENCE:-5} VALID_EVERY=${VALID_EVERY:-160} AVERAGE=${AVERAGE:-5}
DS_CONFIG=${DS_CONFIG:-ds_configs/zero1.json}
for var in MAX_UPDATES PATIENCE VALID_EVERY AVERAGE; do  # before hours of training, not after
    [[ ${!var} =~ ^[1-9][0-9]*$ ]] || { echo "depth_pays.sh: $var must be a positive integer, got '${!var}'" >&2; exit 2; }
done
# Every run must record AVERAGE validations: one that stops on PATIENCE records at least PATIENCE + 1,
# one that reaches MAX_UPDATES (never validated at its last update) (MAX_UPDATES - 1) / VALID_EVERY.
(( AVERAGE <= PATIENCE + 1 && AVERAGE <= (MAX_UPDATES - 1) / VALID_EVERY )) || {
    echo "depth_pays.sh: AVERAGE=$AVERAGE checkpoints of lowest validation loss need PATIENCE >= $((AVERAGE - 1))" \
         "and MAX_UPDATES > $((AVERAGE * VALID_EVERY)) (validations every VALID_EVERY=$VALID_EVERY updates)" >&2; exit 2; }
[ -f "$DS_CONFIG" ] || { echo "depth_pays.sh: DS_CONFIG: no such file '$DS_CONFIG'" >&2; exit 2; }
case $INIT in
    admin) MODEL=(--model.init=admin) ;;
    post)  MODEL=(--model.init=default) ;;
    pre)   MODEL=(--model.init=default --model.norm_order=pre) ;;
    *) echo "depth_pays.sh: INIT must be admin, post or pre, got '$INIT'" >&2; exit 2 ;;
esac
for depth in "${DEPTHS[@]}"; do  # every depth checked before any work
    [[ $depth =~ ^[1-9][0-9]*-[1-9][0-9]*$ ]] || {
        echo "depth_pays.sh: a depth is E-D with positive integers (e.g. 60-12), got '$depth'" >&2; exit 2; }
done
DATA=$OUT/data
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

python -m data_prep.prepare en-de "$DATA" --raw-dir "$RAW" --valid-prefix val \
    --test-prefix test_2016_flickr --vocab-size 8000

hyps=()
for depth in "${DEPTHS[@]}"; do
    enc=${depth%-*} dec=${depth#*-}
    run=$OUT/${INIT}_${enc}L-${dec}L
    args=(--config launch/configs/multi30k_en_de.yaml "${MODEL[@]}" --data.path="$DATA"
          --model.num_encoder_layers="$enc" --model.num_decoder_layers="$dec" --train.run_dir="$run"
          --train.max_updates="$MAX_UPDATES" --train.patience="$PATIENCE"
          --train.valid_interval_updates="$VALID_EVERY" --train.save_interval_updates="$VALID_EVERY"
          --train.keep_last=1 --train.keep_best="$AVERAGE" --train.final_eval=false)
    echo "[depth] $run: training (${enc}L-${dec}L, $INIT)"
    if (( enc + dec >= 60 )); then
        python -m torch.distributed.run --standalone --nproc_per_node 2 launch/train.py \
            --deepspeed_config "$DS_CONFIG" "${args[@]}" --engine.pipeline_stages=2
    else
        python launch/train.py --deepspeed_config "$DS_CONFIG" "${args[@]}"
    fi
    avg=$run/best$AVERAGE.pt hyp=$run/test.best$AVERAGE.hyp.de
    if [ ! -s "$hyp" ] || [ "$hyp" -ot "$run/checkpoints/latest_complete" ]; then
        python launch/average_checkpoints.py --run "$run" --best "$AVERAGE" --out "$avg"
        python launch/translate.py --checkpoint "$avg" --input "$DATA/test.en" --beam 4 --lenpen 0.6 > "$hyp.tmp"
        mv "$hyp.tmp" "$hyp"
    fi
    hyps+=("$hyp")
done

echo "[depth] what each model cost (its summary.json, over all resumes; CPU hours: every rank's process)"
for hyp in "${hyps[@]}"; do
    python - "$(dirname "$hyp")/summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"{sys.argv[1]}: {s.get('parameters', 0) / 1e6:.1f}M parameters, {s['updates']} updates, converged "
      f"{s.get('converged')}, best validation loss {s.get('best_valid_loss')}, {s.get('cpu_hours', 'unrecorded')} CPU hours, "
      f"{s.get('wall_hours', 'unrecorded')} hours of wall time")
PY
done
runs=(); for hyp in "${hyps[@]}"; do runs+=("$(dirname "$hyp")"); done
echo "[depth] training and validation curves: $OUT/curves.png"
python launch/plot_runs.py "${runs[@]}" --out "$OUT/curves.png"
echo "[depth] test2016, beam 4, the average of each run's $AVERAGE checkpoints of lowest validation loss"
if (( ${#hyps[@]} == 1 )); then
    python launch/evaluate.py --hyp "${hyps[0]}" --ref "$DATA/test.de" --lang en-de
fi
for (( i = 0; i + 1 < ${#hyps[@]}; i++ )); do  # every pair: each model against every deeper one
    python launch/evaluate.py --hyp "${hyps[i]}" --ref "$DATA/test.de" --lang en-de --compare "${hyps[@]:i+1}"
done
