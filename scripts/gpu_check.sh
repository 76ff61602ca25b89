#!/usr/bin/env bash
# Every GPU path of diag in one run, on a machine with an NVIDIA GPU and no network: the `gpu`
# tests, the device bench (NVML families, precheck device health, matmul against the published
# peak, pinned copy bandwidth), attach's overhead on a GPU model, and the flash checkpoint bench
# on CUDA. Each step has its own time limit, cut to what is left of the whole run's budget, and a
# failed step does not stop the next one.
#
#     OUT=/some/dir scripts/gpu_check.sh           # on the GPU machine (python3 with torch)
#     GPU_CHECK_LOCAL=1 scripts/gpu_check.sh       # here: the project's .venv, nothing installed
#     GPU_CHECK_STEPS=tests_gpu_resilient,goodput_gpu scripts/gpu_check.sh   # those steps alone
#
# OUT is the output folder given by the environment (default ./gpu-out). It receives three
# files: gpu.log (everything printed), results.json (each step's status and the numbers) and
# artifacts.tar.gz (per-step logs, JUnit XML, the hang test's incident and its merged stacks).
# Without GPU_CHECK_LOCAL, the wheels in .whl/ (the packages the machine lacks) are installed
# into /tmp/site and diag itself is installed there from this checkout, with no network.
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 1
OUT="${OUT:-$root/gpu-out}"
mkdir -p "$OUT"
budget="${GPU_CHECK_BUDGET_S:-400}"
work="$(mktemp -d /tmp/gpu-check.XXXXXX)"
steps="$work/steps"
mkdir -p "$steps"
exec > >(tee -a "$OUT/gpu.log") 2>&1
export PYTHONUNBUFFERED=1 DS_BUILD_OPS=0 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
t_start=$SECONDS
: > "$work/status.tsv"

if [[ -n "${GPU_CHECK_LOCAL:-}" ]]; then
    py="$root/.venv/bin/python"
    export PATH="$root/.venv/bin:$PATH"
else
    py="$(command -v python3)"
fi

left() { echo $((budget - (SECONDS - t_start))); }
only="${GPU_CHECK_STEPS:-}"  # comma-separated step names; empty: every step

# step NAME LIMIT_S CMD...: runs CMD with its output in the log and in steps/NAME.log, under
# `timeout` (the smaller of LIMIT_S and what is left of the budget), and records its status.
step() {
    local name=$1 limit=$2
    shift 2
    if [[ -n "$only" && ",$only," != *",$name,"* ]]; then
        return
    fi
    local remaining
    remaining=$(left)
    if ((remaining < 15)); then
        echo "=== [$name] skipped: budget spent ($((SECONDS - t_start)) s)"
        printf '%s\tskipped\t0\t%s\n' "$name" "no time left" >> "$work/status.tsv"
        return
    fi
    ((limit > remaining)) && limit=$remaining
    echo
    echo "=== [$name] start at +$((SECONDS - t_start)) s, limit ${limit} s: $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$steps/$name.log"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - t0))
    local how=ok
    ((rc == 124 || rc == 137)) && how=timeout
    ((rc != 0 && rc != 124 && rc != 137)) && how=failed
    echo "=== [$name] $how (rc $rc) in ${took} s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$how" "$took" "rc $rc" >> "$work/status.tsv"
}

setup() {
    if [[ -n "${GPU_CHECK_LOCAL:-}" ]]; then
        echo "local mode: $py, nothing installed"
        return 0
    fi
    local site=/tmp/site
    rm -rf "$site"
    if compgen -G ".whl/*.whl" > /dev/null; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" .whl/*.whl || return 1
    else
        echo "no .whl/ folder: installing nothing but diag"
    fi
    # diag from this checkout, no network: a wheel built with the machine's setuptools, or,
    # if that fails, the package folders linked under diag/ (the layout pyproject maps).
    if ! "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
        --no-cache-dir --target "$site" . ; then
        echo "pip could not install diag; linking the package folders instead"
        mkdir -p "$site/diag"
        for d in agent collector viewer trainer proto; do ln -sfn "$root/$d" "$site/diag/$d"; done
    fi
    return 0
}

echo "gpu_check: $(date -u +%FT%TZ) on $(hostname), budget ${budget} s, out $OUT"
t0=$SECONDS
setup
rc=$?
how=ok
((rc != 0)) && how=failed
echo "=== [setup] $how (rc $rc) in $((SECONDS - t0)) s"
printf '%s\t%s\t%s\t%s\n' setup "$how" "$((SECONDS - t0))" "rc $rc" >> "$work/status.tsv"
if [[ -z "${GPU_CHECK_LOCAL:-}" ]]; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="/tmp/site/bin:$PATH"
    # Tests start `diag` and py-spy from beside the interpreter (netlab.py, pyspy.py).
    bindir="$(dirname "$py")"
    if [[ ! -e "$bindir/diag" && -w "$bindir" ]]; then
        printf '#!/bin/sh\nexec "%s" -m diag.cli.main "$@"\n' "$py" > "$bindir/diag"
        chmod +x "$bindir/diag"
    fi
    [[ ! -e "$bindir/py-spy" && -x /tmp/site/bin/py-spy && -w "$bindir" ]] &&
        ln -s /tmp/site/bin/py-spy "$bindir/py-spy"
fi

step env 60 bash -c "
    nvidia-smi || echo 'nvidia-smi: not here'
    '$py' - <<'EOF'
import importlib, platform, shutil
print('python', platform.python_version(), platform.machine())
for name in ('torch', 'deepspeed', 'diag.agent', 'pynvml', 'cupy', 'grpc', 'google.protobuf',
             'prometheus_client', 'orjson', 'pydantic', 'dlrover', 'pytest', 'pytest_timeout'):
    try:
        m = importlib.import_module(name)
        print(f'{name:18} {getattr(m, \"__version__\", \"\")} {getattr(m, \"__file__\", \"\")}')
    except Exception as e:
        print(f'{name:18} MISSING ({type(e).__name__}: {e})')
import torch
print('cuda', torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')
if torch.cuda.is_available():
    print('nccl', torch.cuda.nccl.version())
print('py-spy', shutil.which('py-spy'), 'diag', shutil.which('diag'))
EOF"

# 1. The device itself: NVML families, precheck health, matmul vs the published peak, copies.
step device 90 "$py" bench/gpu_device.py --json "$work/device.json" --matmul-size 8192 --seconds 3

# 2. The quick gpu tests (the hang on the device, named as blocked on the device, with the
# NCCL flight recorder the agent took; NVML, precheck, node health, pinned copies).
step tests_gpu 200 "$py" -m pytest -m gpu -q -p no:cacheprovider --timeout 180 \
    --basetemp "$work/pytest" --junitxml "$work/junit-gpu.xml" \
    tests/collector/test_collector_gpu.py tests/agent/metrics/test_metrics_gpu.py tests/agent/precheck/test_precheck_gpu.py \
    tests/agent/health/test_node_health.py "tests/trainer/flash/test_flash_gpu.py::test_device_storages_land_in_pinned_shared_memory"

# The hang test's incident, merged: the stacks and the journal tails beside each other.
incident_timeline="$(find "$work/pytest" -type d -name timeline -path '*collective_held*' 2> /dev/null | head -1)"
if [[ -n "$incident_timeline" ]]; then
    step merge 60 "$py" -m diag.cli.main merge --path "$incident_timeline"
elif [[ -z "$only" || ",$only," == *",merge,"* ]]; then
    echo "=== [merge] skipped: no incident from the hang test"
    printf '%s\t%s\t0\t%s\n' merge skipped "no incident" >> "$work/status.tsv"
fi

# 3. The DeepSpeed GPU jobs resumed bit for bit from memory (the tests before the benches: a
# run cut short by its budget loses figures, not checks).
step tests_gpu_resume 200 "$py" -m pytest -m gpu -q -p no:cacheprovider --timeout 200 \
    --basetemp "$work/pytest-resume" --junitxml "$work/junit-gpu-resume.xml" \
    tests/trainer/flash/test_flash_gpu.py -k resumes


# 3b. In-place recovery on NCCL: two ranks on the one GPU, each its own "node" (NCCL_HOSTID),
# their communicators aborted from another thread while one waits in a collective, four
# recoveries in the same processes (losses against an uninterrupted run, GPU memory and handles
# held), and the agent's verdict ending an NCCL wait.
# The agent's verdict first: the four-recovery test is an open question (xfail, up to 240 s).
step tests_gpu_resilient 330 "$py" -m pytest -m gpu -q -s -p no:cacheprovider --timeout 300 \
    --basetemp "$work/pytest-resilient" --junitxml "$work/junit-gpu-resilient.xml" \
    tests/trainer/resilient/test_resilient_gpu.py::test_the_agents_verdict_aborts_an_nccl_wait \
    tests/trainer/resilient/test_resilient_gpu.py::test_nccl_groups_aborted_from_another_thread_recover_in_place

# 4. Flash checkpoint on CUDA: ~3.2 GB of ZeRO-2 state (200 M parameters, fp32 Adam), against
# engine.save_checkpoint and DLRover's flash checkpoint on the same engine (--dlrover: its row
# says why when DLRover cannot run; its saver and shm are removed after).
step flash_bench 180 "$py" bench/flash_checkpoint.py --gpu --dlrover --params-m 200 --repeats 3 \
    --json "$work/flash.json"

# 5. attach's overhead on a GPU model, with and without, interleaved in the same processes.
step attach_overhead 120 "$py" bench/bench_collector.py --gpu --blocks 8 --json "$work/attach.json"

echo
echo "=== summary after $((SECONDS - t_start)) s"
column -t -s $'\t' "$work/status.tsv" 2> /dev/null || cat "$work/status.tsv"

# results.json: each step's status, and the numbers the benches wrote.
"$py" - "$work" "$OUT/results.json" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
doc = {"steps": []}
for line in (work / "status.tsv").read_text().splitlines():
    name, how, seconds, note = (line.split("\t") + ["", "", "", ""])[:4]
    doc["steps"].append({"name": name, "status": how, "seconds": int(seconds or 0), "note": note})
for key, name in (("device", "device.json"), ("attach_overhead", "attach.json"),
                  ("flash", "flash.json")):
    p = work / name
    doc[key] = json.loads(p.read_text()) if p.exists() else None
tests = []
for xml in sorted(work.glob("junit-*.xml")):
    for case in ET.parse(xml).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
                msg = (child.get("message") or "")[:500]
                break
        else:
            msg = ""
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}",
                      "outcome": outcome, "seconds": float(case.get("time") or 0),
                      "message": msg})
doc["tests"] = tests
out.write_text(json.dumps(doc, indent=1, default=str))
print(f"results: {out} ({len(tests)} test cases)")
for t in tests:
    print(f"  {t['outcome']:8} {t['seconds']:7.1f} s  {t['test']}  {t['message'][:160]}")
EOF

# One tarball of what else is worth reading: step logs, JUnit XML, the benches' JSON, and the
# small files of the test runs (incidents, merged SVGs, job and agent logs).
(
    cd "$work" || exit
    find . -type f -size -4M \( -name '*.log' -o -name '*.xml' -o -name '*.json' -o \
        -name '*.svg' -o -name '*.folded' -o -name '*.txt' -o -name '*.tsv' \) \
        -not -path './pytest*/tmpdir*' -print0 |
        tar --null -czf "$OUT/artifacts.tar.gz" --files-from=- 2> /dev/null
)
ls -la "$OUT"
echo "gpu_check: done in $((SECONDS - t_start)) s"
rm -rf "$work"
exit 0
