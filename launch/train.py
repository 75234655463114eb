"""Train an Admin encoder-decoder with DeepSpeed: profile omega across all ranks, then train.

    deepspeed launch/train.py --deepspeed_config ds_configs/zero2.json
        # no data given: the embedded default (generated corpus, tiny preset), BLEU at the end
    deepspeed launch/train.py --deepspeed_config ds_configs/zero2_bf16.json \\
        --config launch/configs/wmt14_en_de_admin_60L12L.yaml
    deepspeed --num_gpus 8 launch/train.py --deepspeed_config ds_configs/zero1_bf16.json \\
        --config run.yaml --train.max_updates=50000 --model.num_encoder_layers=36
    python launch/train.py ...                       # one process, no launcher

Options: --config FILE (YAML run config), --section.key=value overrides (see
admin_ds/train/run_config.py), --profile-only (write the Admin profile and exit), --profile PATH (reuse
admin_profile.json or a reference profile.ratio.init). The DeepSpeed JSON says how to run; the run
config says what to train.

Exit status: 0 done; 2 bad input (one line on stderr); 3 a rank was lost or hung (the message names
it; admin_ds/train/watchdog.py); 75 a signal (SIGTERM, SIGUSR1, SIGINT) stopped the run after a
checkpoint: run the same command again (launch/slurm.sbatch and launch/requeue.sh do).
"""

import argparse
import os
import sys

from admin_ds import logs
from admin_ds.arguments import input_file


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", required=True, help="engine JSON (ds_configs/*.json)")
    p.add_argument("--config", help="run config YAML (launch/configs/*.yaml)")
    p.add_argument("--profile-only", action="store_true", help="write the Admin profile and exit")
    p.add_argument("--profile", type=input_file,
                   help="reuse a profile (admin_profile.json, profile.ratio.init or a deepnmt profile)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    return p.parse_known_args(argv)


def check_bleu_decoding(run) -> None:
    """The BLEU evaluation's decoding, bounded as translate.py's is (admin_ds/inference/limits.py):
    refused before any work rather than after the last update."""
    from admin_ds.errors import ConfigError
    from admin_ds.inference.limits import DEFAULT_MAX_DECODE_CELLS, check_decoding

    t = run.train
    problem = check_decoding(t.bleu_beam, run.data.max_tokens, t.bleu_max_len_a, t.bleu_max_len_b, None,
                             t.bleu_max_decode_cells or DEFAULT_MAX_DECODE_CELLS,
                             {"beam": "train.bleu_beam", "max_tokens": "data.max_tokens",
                              "max_len_a": "train.bleu_max_len_a", "max_len_b": "train.bleu_max_len_b",
                              "max_cells": "train.bleu_max_decode_cells"})
    if problem:
        raise ConfigError(problem)


def main(argv=None, hooks=None) -> int:
    """``hooks``: callbacks at fixed points of the run (admin_ds/train/hooks.py); tests use them."""
    args, overrides = parse_args(argv)
    logs.quiet_known_warnings()
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    from admin_ds.errors import UserError
    from admin_ds.train import ds_config
    from admin_ds.train.run_config import load_run_config

    try:
        run = load_run_config(args.config, overrides)
        ds_config.read(args.deepspeed_config)  # refused before torch and DeepSpeed are imported
        if args.profile_only:
            run.admin.profile_only = True
        if args.profile:
            run.admin.profile = str(args.profile)
        check_bleu_decoding(run)
        from admin_ds.inference.scoring import score
        from admin_ds.inference.translate import translate
        from admin_ds.train.evaluator import BleuTools
        from admin_ds.train.loop import train
        from admin_ds.train.preemption import REQUEUE_STATUS

        summary = train(run, args.deepspeed_config, hooks, BleuTools(translate, score))
    except (UserError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file the run needs cannot be read or written
        from admin_ds.files import describe_os_error

        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        return 2
    return REQUEUE_STATUS if summary.get("requeue") else 0


if __name__ == "__main__":
    sys.exit(main())
