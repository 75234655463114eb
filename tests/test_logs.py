"""What commands print: progress lines off a terminal, and the known harmless messages dropped
(admin_ds/logs.py) while real ones are kept."""

import json
import subprocess
import sys

from distributed import REPO, free_port
from launching import clean_env, run_args

from admin_ds import logs

# What each dropped message looks like in a log (admin_ds/logs.py says why each is harmless).
KNOWN = ["untested optimizer", "autograd kernel was not registered", "SEED_LAYERS=", "Using topology",
         "args = Namespace("]


def test_progress_off_a_terminal_is_a_line_per_tenth(capsys):
    with logs.progress(25, "bleu test") as bar:
        for _ in range(25):
            bar.update(1)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "[bleu test] 3/25 sentences" and err[-1] == "[bleu test] 25/25 sentences"
    assert len(err) == 10
    with logs.progress(25, "bleu test", disable=True) as bar:
        bar.update(25)
    assert capsys.readouterr().err == ""


def test_known_prints_are_dropped_and_others_kept(capsys):
    with logs.without_known_prints():
        print("SEED_LAYERS=False BASE_SEED=1234 SEED_FN=None")
        print("a line that stays")
        print("Using topology: {ProcessCoord(pipe=0, data=0): 0}")
    assert capsys.readouterr().out == "a line that stays\n"


def test_a_pipeline_run_and_its_conversion_log_no_known_message_but_a_real_warning(tmp_path, data_dir):
    """A 2-stage pipeline run with RAdam under ZeRO-1 (the untested-optimizer banner, the c10d
    broadcast warning and the pipeline module's prints, before admin_ds/logs.py), its checkpoint
    averaged (DeepSpeed's universal converter: the args line). The run's BLEU evaluation decodes
    test sentences longer than the model's 12 positions: translate's truncation warning, a real
    one, must stay."""
    run = tmp_path / "run"
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), str(REPO / "launch/train.py"),
           *run_args(run, data_dir, free_port(), 2, ds=REPO / "ds_configs/pipeline.json"),
           "--train.save_interval_updates=2", "--train.final_eval=true", "--train.bleu_max_sentences=20",
           "--train.bleu_beam=1", "--model.max_positions=12", "--data.max_positions=12"]
    train = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=600, cwd=REPO)
    log = train.stdout + train.stderr
    assert train.returncode == 0, log[-3000:]
    assert json.loads((run / "summary.json").read_text())["updates"] == 2
    average = subprocess.run([sys.executable, str(REPO / "launch/average_checkpoints.py"), "--run", str(run),
                              "--last", "1", "--out", str(tmp_path / "avg.pt")],
                             capture_output=True, text=True, env=clean_env(), timeout=300, cwd=REPO)
    assert average.returncode == 0, average.stderr[-3000:]
    both = log + average.stdout + average.stderr
    assert "[pipeline] 2 stages" in log and "[bleu test] 20/20 sentences" in log
    assert [known for known in KNOWN if known in both] == []
    assert "UserWarning: translate:" in log and "longer than max_positions=12 were truncated" in log
