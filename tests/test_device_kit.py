"""bench/device_kit.sh on a CPU (``run --cpu``): the path a GPU machine runs, minus the
installation and the GPU-only work, so the kit does not rot between GPU sessions. The GPU suite
is collected and skipped (no CUDA here) with its reason in the JUnit XML; the throughput
benchmark runs debug-tiny for a few updates and writes its JSON, with the measured peak, MFU
against it and the time breakdown; the summary names both."""

import json
import os
import subprocess
import xml.etree.ElementTree as ET

import pytest

from distributed import REPO, free_port

CATEGORIES = ("matmul", "attention", "layer norm", "other compute", "optimizer", "DeepSpeed", "data",
              "outside operators")


def test_kit_run_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(free_port()))
    proc = subprocess.run(["bash", str(REPO / "bench/device_kit.sh"), "run", "--cpu", "-", str(out)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["environment.json", "gpu_suite.log", "gpu_suite.xml",
                                                      "summary.md", "throughput.jsonl", "throughput.log"]

    cases = list(ET.parse(out / "gpu_suite.xml").getroot().iter("testcase"))
    assert len(cases) >= 15
    for case in cases:
        skipped = case.find("skipped")
        assert skipped is not None and "no CUDA device" in skipped.get("message", ""), case.get("name")

    rows = [json.loads(line) for line in (out / "throughput.jsonl").read_text().splitlines()]
    assert [r["overrides"][2:] for r in rows] == [["--engine.skip_padding=false", "--engine.dropout=torch"], []]  # after the corpus size
    for r in rows:
        assert r["preset"] == "debug-tiny" and r["device"] == "cpu" and r["tokens_per_s"] > 0
        assert r["peak_tflops"] > 0 and r["mfu_measured"] == pytest.approx(r["tflops"] / r["peak_tflops"], rel=0.02)
        assert r["mfu_vs_square"] == r["mfu_measured"]
        assert r["mfu_vs_layer"] == pytest.approx(r["tflops"] / r["layer_gemm_tflops"], rel=0.02)
        assert r["vendor_tflops"] is None and r["mfu_vendor"] is None
        assert 0 < r["padding"] < 0.5 and r["padded_tflops"] > r["tflops"]
    seconds = rows[0]["breakdown_s"]
    assert list(seconds) == list(CATEGORIES)
    assert seconds["matmul"] > 0 and seconds["attention"] > 0 and seconds["optimizer"] > 0 and seconds["DeepSpeed"] > 0

    summary = (out / "summary.md").read_text()
    assert "## GPU suite (tests/gpu)" in summary and "0 passed, 0 failed, " in summary
    assert "| debug-tiny | fp32 | 2 | --data.default_pairs=1500" in summary and "| matmul |" in summary
    assert json.loads((out / "environment.json").read_text())["deepspeed"]
