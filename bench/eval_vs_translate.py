"""The end-of-training BLEU evaluation against launch/translate.py: the same model, the same test
sentences, the same decoding options, one run.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python bench/eval_vs_translate.py --data data/multi30k_en_de \\
        --config launch/configs/multi30k_en_de.yaml --updates 60 --sentences 500 [-- --train.bleu_beam=5 ...]

Trains --updates updates with launch/train.py (one process, ZeRO-1, a checkpoint at the last update),
whose final evaluation decodes the first --sentences test sentences (Evaluator.bleu; its decode time
is ``decode_s`` in the run's metrics.jsonl). Then launch/translate.py decodes the same sentences from
that checkpoint with the run's train.bleu_* options and data.max_tokens. Prints both decode times
(translate.py's own "[translate] ... in X s"), their ratio, and whether the two outputs are equal,
which they must be. Arguments after ``--`` go to launch/train.py (an early model that rarely ends its
hypotheses is the slow case: a few dozen updates).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a prepared data directory (data_prep.prepare)")
    p.add_argument("--config", default=str(REPO / "launch/configs/multi30k_en_de.yaml"))
    p.add_argument("--updates", type=int, default=60)
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--out", default=None, help="the run directory (default: a temporary one)")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    out = Path(args.out or tempfile.mkdtemp(prefix="eval_vs_translate."))
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "run"
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    n = args.updates
    train = [sys.executable, str(REPO / "launch/train.py"), "--deepspeed_config", str(REPO / "ds_configs/zero1.json"),
             "--config", args.config, f"--data.path={args.data}", f"--train.run_dir={run_dir}",
             f"--train.max_updates={n}", f"--train.save_interval_updates={n}", f"--train.valid_interval_updates={n}",
             f"--train.bleu_max_sentences={args.sentences}", "--train.final_eval=true", *extra]
    with open(out / "train.log", "w") as log:
        subprocess.run(train, stdout=log, stderr=subprocess.STDOUT, env=env, check=True, cwd=REPO)
    test = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    test = [r for r in test if r["kind"] == "test"][-1]
    cfg = json.loads((run_dir / "run_config.json").read_text())
    manifest = json.loads((Path(args.data) / "manifest.json").read_text())
    src, tgt = manifest["src_lang"], manifest["tgt_lang"]
    lines = (Path(args.data) / f"test.{src}").read_text(encoding="utf-8").splitlines()[:args.sentences]
    (out / f"test.{src}").write_text("\n".join(lines) + "\n", encoding="utf-8")

    t = cfg["train"]
    translate = [sys.executable, str(REPO / "launch/translate.py"), "--checkpoint", str(run_dir), "--input",
                 str(out / f"test.{src}"), "--beam", str(t["bleu_beam"]), "--lenpen", str(t["bleu_lenpen"]),
                 "--max-tokens", str(cfg["data"]["max_tokens"]), "--max-len-a", str(t["bleu_max_len_a"]),
                 "--max-len-b", str(t["bleu_max_len_b"]), "--quiet"]
    t0 = time.perf_counter()
    done = subprocess.run(translate, capture_output=True, text=True, env=env, check=True, cwd=REPO)
    wall = time.perf_counter() - t0
    decode_s = float(re.search(r"\[translate\] \d+ sentences in ([0-9.]+)s", done.stderr).group(1))
    hyps = (run_dir / f"test.hyp.{tgt}").read_text(encoding="utf-8").splitlines()
    same = hyps == done.stdout.splitlines()
    print(json.dumps({"sentences": len(lines), "updates": n, "beam": t["bleu_beam"],
                      "max_len": f"{t['bleu_max_len_a']} x src + {t['bleu_max_len_b']}",
                      "evaluator_decode_s": test["decode_s"], "translate_decode_s": decode_s,
                      "translate_wall_s": round(wall, 2), "ratio": round(test["decode_s"] / decode_s, 2),
                      "same_output": same, "bleu": test["bleu"], "loadavg": os.getloadavg(), "out": str(out)}))
    if not same:
        sys.exit("the evaluator's translations differ from translate.py's")


if __name__ == "__main__":
    main()
