"""Write `.deepspeed_env`: the variables DeepSpeed's multi-node launchers do not forward by themselves.

    python launch/cluster_env.py [--set KEY=VALUE ...] [--out .deepspeed_env]

The pdsh, openmpi and slurm launchers of `deepspeed` export only variables whose names start with
PYTHON, MLFLOW, MV2 or UCX (plus NCCL* on CUDA) to the other nodes, and lines of a `.deepspeed_env`
file in the working directory or home. The accelerator choice, thread counts, NCCL/gloo interface
settings and the project's PYTHONPATH go there, so every node sees the environment of this one.
"""

import argparse
import os
import sys
from pathlib import Path


from admin_ds import files
from admin_ds.arguments import output_file

FORWARDED_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "CUDA_DEVICE_MAX_CONNECTIONS", "FI_", "UCX_")
FORWARDED_NAMES = ("DS_ACCELERATOR", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCH_EXTENSIONS_DIR",
                   "HF_DATASETS_CACHE", "HF_HOME")


def collect(extra: list[str]) -> dict[str, str]:
    repo = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k in FORWARDED_NAMES or k.startswith(FORWARDED_PREFIXES)}
    path = os.environ.get("PYTHONPATH", "")
    env["PYTHONPATH"] = repo if not path else f"{repo}:{path}" if repo not in path.split(":") else path
    for item in extra:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        env[key] = value
    for key, value in env.items():
        if "\n" in value:
            raise ValueError(f"{key} contains a newline; .deepspeed_env holds one KEY=VALUE per line")
    return env


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", type=output_file, default=".deepspeed_env")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        env = collect(args.set)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files.write_text(args.out, "".join(f"{k}={v}\n" for k, v in sorted(env.items())))
    print(f"wrote {args.out}: {', '.join(sorted(env))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
