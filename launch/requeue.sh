#!/usr/bin/env bash
# Run a training command again for as long as it exits with status 75, "saved for requeue": a
# signal (SIGTERM, SIGUSR1, SIGINT) to any rank made every rank write a checkpoint at the next
# update boundary and leave (admin_ds/train/preemption.py); the next attempt resumes from it. Any
# other status ends the loop with that status. For launches without Slurm (launch/slurm.sbatch
# requeues itself):
#
#   bash launch/requeue.sh deepspeed --num_gpus 8 launch/train.py --deepspeed_config ... --config ...
#   bash launch/requeue.sh --max-requeues 20 deepspeed --hostfile hosts launch/train.py ...
#
# To make a run save and requeue, signal its ranks (`kill -USR1 <pid of any rank>`), not the
# deepspeed launcher: on SIGTERM or SIGINT the launcher terminates its ranks (SIGTERM, which they
# take as a stop request, then SIGKILL after 30 s) and exits with 1. A signal to this script stops
# the loop: SIGTERM goes to every process of the running attempt (its own process group: the
# launcher and the ranks, which save at their next update boundary), and this script exits with
# the command's status once they have all ended (SIGKILL for what remains after 60 s).
set -u
set -m  # each attempt in a process group of its own, so that a stop reaches all of its processes
max_requeues=100
if [ "${1:-}" = "--max-requeues" ]; then
    # Checked here: the loop compares it only after the first attempt, where a non-number makes
    # `[` fail and leaves the requeues unbounded. At most 9 digits, inside bash's integers.
    if ! [[ "${2:-}" =~ ^[0-9]{1,9}$ ]]; then
        echo "error: --max-requeues: expected a non-negative integer (at most 9 digits), got '${2:-}'" >&2
        exit 2
    fi
    max_requeues=$((10#$2))
    shift 2
fi
if [ $# -eq 0 ]; then
    echo "usage: bash launch/requeue.sh [--max-requeues N] COMMAND [ARGS...]" >&2
    exit 2
fi
stopping=0
child=
trap 'stopping=1; [ -n "$child" ] && kill -TERM -- "-$child" 2>/dev/null' INT TERM
for ((attempt = 1; ; attempt++)); do
    "$@" &
    child=$!
    while true; do
        wait "$child"
        status=$?
        kill -0 "$child" 2>/dev/null || break  # a trapped signal interrupted the wait
    done
    for _ in $(seq 60); do  # the first process may end before the others of its group
        kill -0 -- "-$child" 2>/dev/null || break
        sleep 1
    done
    kill -KILL -- "-$child" 2>/dev/null
    child=
    if [ "$status" -ne 75 ] || [ "$stopping" -eq 1 ]; then
        exit "$status"
    fi
    if [ "$attempt" -gt "$max_requeues" ]; then
        echo "[requeue] the run asked for a requeue $attempt times; giving up (--max-requeues $max_requeues)" >&2
        exit 75
    fi
    echo "[requeue] status 75: the run saved a checkpoint; starting attempt $((attempt + 1))" >&2
done
