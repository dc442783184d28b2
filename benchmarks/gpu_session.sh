#!/usr/bin/env bash
# One lease of a lent GPU machine (no network there): install the carried wheels, run the CUDA
# tests, probe the machine, benchmark the executor against all-GPU eager PyTorch, the built-in
# demo, and (time left) the whole suite. Every stage has its own time limit and log, so one that
# fails does not hide the others; the summary is printed last.
#
# Here, once: wheels the machine lacks (its image has torch, transformers, pytest, xxhash, ...):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl pulp==3.3.2 highspy==1.16.0
# Then: device run, carry [".whl"], command "bash benchmarks/gpu_session.sh [STAGES]".
# STAGES (default "env cuda probe bench demo suite"; also "profile"); BENCH="model:batch:seq:gpu-mem:precision[:steps] ...",
# BENCH_ARGS (more bench_executor arguments), HW (a spec file instead of probing), SUITE_END (seconds).
set -u
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STAGES=${*:-env cuda probe bench demo suite}
BENCH=${BENCH:-"gpt3-125m:8:1024:8GB:bf16-mixed"}
T0=$(date +%s)
stage() { echo "== $1 (+$(( $(date +%s) - T0 )) s)"; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "editable install failed:"; tail -5 "$OUT/install.log"; exit 1; }

for s in $STAGES; do
  stage "$s"
  case $s in
    env)
      { nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.max.sm --format=csv
        python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
        echo "cores $(nproc)"; free -g | head -2; df -h . /tmp | tail -2; lsblk -d -o NAME,ROTA,SIZE,MODEL 2>/dev/null
      } 2>&1 | tee "$OUT/env.log" ;;
    cuda)
      timeout 300 python3 -m pytest tests/test_executor_cuda.py tests/test_cuda_lanes.py tests/test_device_ops.py -n 0 -p no:cacheprovider \
        -q -rs --timeout 240 >"$OUT/cuda_tests.log" 2>&1
      echo "rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|skipped" "$OUT/cuda_tests.log" | tail -15 ;;
    probe)
      timeout 240 python3 -m tensorstow.cli probe -o "$OUT/probe.json" >"$OUT/probe.log" 2>&1
      echo "rc $?"; tail -4 "$OUT/probe.log" ;;
    bench)
      hw=${HW:-local}; [ -s "$OUT/probe.json" ] && hw="$OUT/probe.json"
      for cfg in $BENCH; do
        IFS=: read -r model batch seq mem prec steps <<<"$cfg"
        timeout 300 python3 benchmarks/bench_executor.py --device cuda --hw "$hw" --model "$model" --batch "$batch" \
          --seq "$seq" --gpu-mem "$mem" --precision "$prec" --steps "${steps:-6}" --trace-dir /tmp/traces ${BENCH_ARGS:-} \
          >>"$OUT/bench.log" 2>&1
        echo "rc $? ($cfg)" >>"$OUT/bench.log"
      done
      tar czf "$OUT/traces.tgz" -C /tmp traces 2>/dev/null
      cat "$OUT/bench.log" | grep -v "^  File\|^    " | tail -40 ;;
    profile)
      # where a step's host and device time go, eager vs each executor mode (benchmarks/RESULTS.md)
      hw=${HW:-local}; [ -s "$OUT/probe.json" ] && hw="$OUT/probe.json"
      timeout 300 python3 benchmarks/profile_executor.py --device cuda --hw "$hw" --out "$OUT/profile" \
        >"$OUT/profile.log" 2>&1
      echo "rc $?"; grep -v "^  File\|^    " "$OUT/profile.log" | tail -40 ;;
    demo)
      (cd /tmp && timeout 180 python3 -m tensorstow.cli) >"$OUT/demo.log" 2>&1
      echo "rc $?"; tail -8 "$OUT/demo.log" ;;
    suite)
      left=$(( ${SUITE_END:-560} - ($(date +%s) - T0) ))
      [ "$left" -lt 60 ] && { echo "skipped: ${left}s left"; continue; }
      # CI's shape: 2 torch threads per worker (16 workers of 16 threads each thrash the cores)
      OMP_NUM_THREADS=2 timeout "$left" python3 -m pytest -o addopts="" -n 8 --dist worksteal -p no:cacheprovider \
        -v --tb=line -rf --timeout 300 >"$OUT/suite.log" 2>&1
      echo "rc $?"; grep -E " (FAILED|ERROR) |passed|failed" "$OUT/suite.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | tail -40 ;;
  esac
done
stage done
