#!/usr/bin/env bash
# The device kit: run the GPU suite and the throughput benchmark on a GPU machine that has no
# network, in one call.
#
#   bash bench/device_kit.sh download DIR [--have FREEZE] [--python 3.12]   # where the index is reachable
#   bash bench/device_kit.sh run DIR OUT [--part P]            # on the GPU machine, from the repository root
#   bash bench/device_kit.sh run --cpu - OUT                   # the same path on a CPU (CI): tiny, fast
#
# download: the project's pinned requirements (requirements.txt) and their dependencies that a
#   CUDA PyTorch image does not ship, as files for Python 3.12 (--python) on x86-64 Linux: DeepSpeed as its
#   source distribution (installed with no ops built; they compile on first use), the rest as
#   wheels. Never torch, triton or CUDA wheels: the image's own are kept. The versions are those of
#   the environment this runs in (the project's virtualenv, where the pins are installed). What the
#   image ships is the list below, or exactly `pip list --format=freeze` from the image (--have).
#   Refuses to leave more than 60 MiB in DIR.
# run: installs from DIR with --no-index whatever the image lacks (nothing it has is replaced), then
#   runs the GPU suite (tests/gpu) and the throughput benchmark, writing into OUT:
#     gpu_suite.xml gpu_suite.log    JUnit XML and the log of the suite
#     throughput.jsonl throughput.log   one JSON object per benchmark run (bench/train_throughput.py)
#     environment.json summary.md    versions and device; a short Markdown summary of all of it
#   --part suite | bench | features | all (default all): the suite; the benchmark (presets
#   base-6L-6L, big-6L-6L, admin-18L-18L, admin-60L-12L at 512 and 1024 wide, bf16, ZeRO-1 and
#   ZeRO-2); the training features each measured on and off on base-6L-6L.
#   --cpu: no installation, the suite (which skips every test without CUDA) and the benchmark on
#   debug-tiny for a few updates: the same script path, exercised by tests/test_device_kit.py.
# The exit status is non-zero when a test failed or a benchmark run did not finish.

set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
MAX_MIB=60
# Distributions a CUDA PyTorch image ships (PyTorch with its scientific and Hugging Face stack):
# not downloaded unless --have says otherwise. torch, triton and nvidia-* are never downloaded.
IMAGE_HAS="numpy pyyaml tqdm packaging psutil filelock fsspec typing-extensions sentencepiece sacrebleu
regex click joblib cloudpickle mpi4py matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing
python-dateutil six pyarrow pandas huggingface-hub hf-xet httpx xxhash msgpack einops ninja py-cpuinfo
portalocker tabulate colorama lxml setuptools wheel"

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
die() { echo "error: $*" >&2; exit 2; }

# ---- download -----------------------------------------------------------------------------------

download() {
    local dir="" have="" py="3.12"
    while [ $# -gt 0 ]; do
        case "$1" in
            --have) have="${2:?--have needs a file}"; shift 2 ;;
            --python) py="${2:?--python needs a version, e.g. 3.12}"; shift 2 ;;
            -*) die "download: unknown option $1" ;;
            *) [ -z "$dir" ] || die "download: one DIR"; dir="$1"; shift ;;
        esac
    done
    [ -n "$dir" ] || usage
    [ -z "$have" ] || [ -f "$have" ] || die "--have: no such file: $have"
    mkdir -p "$dir"
    # name==version for every pinned requirement and dependency the image lacks, from this
    # environment's installed metadata (the pins are installed here).
    local needed
    needed="$(IMAGE_HAS="$IMAGE_HAS" HAVE="$have" "$PYTHON" - "$REPO/requirements.txt" <<'EOF'
import os, re, sys
from importlib import metadata

def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()

have = {canon(n) for n in os.environ["IMAGE_HAS"].split()}
if os.environ["HAVE"]:
    have = {canon(re.split(r"[=<>@ ]", line.strip())[0]) for line in open(os.environ["HAVE"]) if line.strip()}
never = lambda n: n in ("torch", "triton") or n.startswith("nvidia-")
todo = [canon(re.split(r"[=<>; ]", line)[0]) for line in open(sys.argv[1])
        if line.strip() and not line.startswith(("#", "-"))]
seen, out = set(), []
while todo:
    name = todo.pop()
    if name in seen or never(name) or name in have:
        continue
    seen.add(name)
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        sys.exit(f"error: {name} is not installed here; run download from the project's environment")
    out.append(f"{name}=={dist.version}")
    for req in dist.requires or []:
        if "extra ==" not in req and not re.search(r"platform_system\s*==\s*.Windows|sys_platform\s*==\s*.win", req):
            todo.append(canon(re.split(r"[=<>!~;\[ (]", req)[0]))
print("\n".join(sorted(out)))
EOF
)"
    echo "[kit] downloading into $dir:" $needed
    local wheel_args=(--no-deps --only-binary=:all: --python-version "$py" --implementation cp --abi "cp${py/./}"
                      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
                      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    for pin in $needed; do
        if [ "${pin%%==*}" = "deepspeed" ]; then
            "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$dir" "$pin"
        elif ! "$PYTHON" -m pip download --quiet "${wheel_args[@]}" -d "$dir" "$pin" 2>/dev/null; then
            "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$dir" "$pin"  # no wheel: sdist
        fi
    done
    printf '%s\n' $needed > "$dir/PINS.txt"
    local size_kib
    size_kib=$(du -sk "$dir" | cut -f1)
    if [ "$size_kib" -gt $((MAX_MIB * 1024)) ]; then
        du -sk "$dir"/* | sort -n >&2
        die "$dir holds $((size_kib / 1024)) MiB, more than $MAX_MIB MiB (files above); pass --have with the image's pip freeze"
    fi
    echo "[kit] $(ls "$dir" | wc -l) files, $((size_kib / 1024)) MiB in $dir"
}

# ---- run ----------------------------------------------------------------------------------------

install_missing() {
    local dir="$1" files=() f name
    [ -d "$dir" ] || die "run: no such kit directory: $dir (make it with: bash bench/device_kit.sh download DIR)"
    for f in "$dir"/*.whl "$dir"/*.tar.gz; do
        [ -e "$f" ] || continue
        name="$(basename "$f")"
        name="${name%%-[0-9]*}"
        if "$PYTHON" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$name" 2>/dev/null; then
            echo "[kit] $name: the image's own is kept"
        else
            files+=("$f")
        fi
    done
    if [ ${#files[@]} -gt 0 ]; then
        echo "[kit] installing:" "${files[@]##*/}"
        # --no-deps: nothing the image has is replaced (torch above all); --no-build-isolation:
        # DeepSpeed's source builds against the image's torch, with no ops (DS_BUILD_OPS=0).
        DS_BUILD_OPS=0 "$PYTHON" -m pip install --quiet --no-index --no-deps --no-build-isolation "${files[@]}"
    fi
}

check_imports() {
    "$PYTHON" - <<'EOF'
import importlib, sys
need = ["torch", "deepspeed", "sentencepiece", "sacrebleu", "sacremoses", "yaml", "numpy", "tqdm"]
missing = []
for name in need:
    try:
        importlib.import_module(name)
    except Exception as e:
        missing.append(f"{name} ({type(e).__name__}: {e})")
if missing:
    sys.exit("error: not importable after installing the kit: " + "; ".join(missing))
EOF
}

environment() {
    "$PYTHON" - "$1" <<'EOF'
import datetime, json, platform, subprocess, sys
import torch
env = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
       "torch": torch.__version__, "cuda": torch.version.cuda,
       "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine(),
       "cpu_threads": torch.get_num_threads()}
try:
    import deepspeed
    env["deepspeed"] = deepspeed.__version__
except Exception as e:
    env["deepspeed"] = f"not importable: {e}"
try:
    env["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
except OSError:
    env["commit"] = None
open(sys.argv[1], "w").write(json.dumps(env, indent=1) + "\n")
EOF
}

summary() {
    local out="$1"
    "$PYTHON" - "$out" "$REPO/bench" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
sys.path.insert(0, sys.argv[2])
from train_throughput import markdown
env = json.loads((out / "environment.json").read_text())
lines = [f"# Device kit: {env['device']}", "",
         f"{env['date']}; torch {env['torch']} (CUDA {env['cuda']}), DeepSpeed {env['deepspeed']}, "
         f"Python {env['python']}, commit {env['commit']}", ""]
suite = out / "gpu_suite.xml"
if suite.exists():
    cases = ET.parse(suite).getroot().iter("testcase")
    status = {"passed": 0, "failed": 0, "skipped": 0}
    failed = []
    for case in cases:
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            status["failed"] += 1
            failed.append(case.get("name"))
        elif "skipped" in kinds:
            status["skipped"] += 1
        else:
            status["passed"] += 1
    lines += ["## GPU suite (tests/gpu)", "", ", ".join(f"{n} {k}" for k, n in status.items())]
    lines += [f"- failed: {name}" for name in failed] + [""]
runs = out / "throughput.jsonl"
if runs.exists():
    rows = [json.loads(line) for line in runs.read_text().splitlines() if line.strip()]
    lines += ["## Throughput (bench/train_throughput.py)", "", markdown(rows), ""]
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
}

run() {
    local cpu=0 part=all args=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --cpu) cpu=1; shift ;;
            --part) part="${2:?--part needs suite, bench, features or all}"; shift 2 ;;
            -) args+=("$1"); shift ;;
            -*) die "run: unknown option $1" ;;
            *) args+=("$1"); shift ;;
        esac
    done
    [ ${#args[@]} -eq 2 ] || usage
    case "$part" in suite|bench|features|all) ;; *) die "--part: expected suite, bench, features or all, got $part" ;; esac
    local dir="${args[0]}" out="${args[1]}" status=0
    mkdir -p "$out"
    out="$(cd "$out" && pwd)"
    cd "$REPO"
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    if [ "$cpu" = 1 ]; then
        export DS_ACCELERATOR=cpu
    else
        install_missing "$dir"
        "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'error: torch sees no CUDA device (use --cpu for the CPU path)')"
    fi
    check_imports
    environment "$out/environment.json"

    if [ "$part" = suite ] || [ "$part" = all ]; then
        echo "[kit] GPU suite -> $out/gpu_suite.xml"
        "$PYTHON" -m pytest tests/gpu -m gpu -q -rs -p no:cacheprovider --junitxml="$out/gpu_suite.xml" \
            > "$out/gpu_suite.log" 2>&1 || status=1
        tail -n 15 "$out/gpu_suite.log"
    fi
    local bench=("$PYTHON" bench/train_throughput.py --json "$out/throughput.jsonl" --run-dir "$out/.runs")
    if [ "$cpu" = 1 ]; then
        # debug-tiny for a few updates on a small corpus: the path, not the figures
        bench+=(--warmup 1 --updates 2 --max-tokens 1024 --peak-size 512 --breakdown --breakdown-updates 1
                --data.default_pairs=1500 --data.default_vocab_size=400)
        if [ "$part" = bench ] || [ "$part" = all ]; then
            "${bench[@]}" --presets debug-tiny --ds ds_configs/zero2.json --engine.skip_padding=false \
                --engine.dropout=torch >> "$out/throughput.log" 2>&1 || status=1   # the plain path
        fi
        if [ "$part" = features ] || [ "$part" = all ]; then
            "${bench[@]}" --presets debug-tiny --ds ds_configs/zero2.json >> "$out/throughput.log" 2>&1 || status=1
        fi
    else
        if [ "$part" = bench ] || [ "$part" = all ]; then
            for ds in zero1_bf16 zero2_bf16; do
                echo "[kit] throughput, $ds"
                "${bench[@]}" --ds "ds_configs/$ds.json" --max-tokens 16384 --updates 20 --breakdown \
                    --presets base-6L-6L big-6L-6L admin-18L-18L admin-60L-12L admin-60L-12L-1024D \
                    --data.pad_to_multiple=8 >> "$out/throughput.log" 2>&1 || status=1
            done
        fi
        if [ "$part" = features ] || [ "$part" = all ]; then
            # each feature against the defaults (base-6L-6L, bf16, ZeRO-2); the first run is the
            # plain path the defaults replaced (padded, torch's masks)
            local variant
            for variant in "--engine.skip_padding=false --engine.dropout=torch" "" --data.pad_to_multiple=8 \
                           --engine.mask_padded_target_keys=true \
                           --engine.activation_checkpointing=true --engine.compile=true --engine.dropout=bulk \
                           "--engine.compile=true --engine.dropout=bulk" \
                           "--optim.optimizer=adamw --optim.implementation=foreach" \
                           "--optim.optimizer=adamw --optim.implementation=fused" \
                           "--optim.optimizer=adamw --optim.implementation=deepspeed" \
                           "--optim.optimizer=adamw --optim.implementation=loop"; do
                echo "[kit] feature run: ${variant:-the defaults}"
                # shellcheck disable=SC2086  # a variant is several words
                "${bench[@]}" --ds ds_configs/zero2_bf16.json --max-tokens 16384 --updates 20 \
                    --presets base-6L-6L $variant >> "$out/throughput.log" 2>&1 || status=1
            done
        fi
    fi
    [ -f "$out/throughput.log" ] && tail -n 5 "$out/throughput.log"
    rm -rf "$out/.runs"
    summary "$out"
    return $status
}

case "${1:-}" in
    download) shift; download "$@" ;;
    run) shift; run "$@" ;;
    *) usage ;;
esac
