#!/usr/bin/env bash
# One GPU round in one call (device tool): environment, build the CUDA kernels, the `cuda` tests, the kernel
# benchmark. Logs and JSON go to $OUT (default ./gpu_out). Run from the repository root:
#   bash bench/gpu_round.sh            # everything
#   STAGES="build bench" bash bench/gpu_round.sh
#   STAGES="e2e" E2E_ARGS="--parts decode --layers 42 --batches 1 --decode-variants stock,g4ops" bash bench/gpu_round.sh
# Liger-Kernel, when carried as a wheel in .whl/, is installed into /tmp/site first (the GPU image lacks it).
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
STAGES=${STAGES:-"env build test bench"}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-360}
export PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
rc=0
has() { [[ " $STAGES " == *" $1 "* ]]; }

if has env; then
  { date -u; nvidia-smi; $PY -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"; nvcc --version | tail -2; } 2>&1 | tee "$OUT/env.log"
fi

if has build; then
  t0=$(date +%s)
  if $PY -m g4ops build --help >/dev/null 2>&1; then
    $PY -m g4ops build --verbose 2>&1 | tee "$OUT/build.log"; brc=${PIPESTATUS[0]}
  else
    $PY -c "import g4ops; print(g4ops.build_kernels(verbose=True))" 2>&1 | tee "$OUT/build.log"; brc=${PIPESTATUS[0]}
  fi
  echo "build rc=$brc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/build.log"
  if [ "$brc" != 0 ]; then echo "BUILD FAILED"; tail -60 "$OUT/build.log"; exit 1; fi
fi

if has test; then
  t0=$(date +%s)
  timeout "$TEST_TIMEOUT" $PY -m pytest -m cuda ${PYTEST_ARGS:--x} -q -p no:cacheprovider tests/ 2>&1 | tee "$OUT/tests.log"
  trc=${PIPESTATUS[0]}
  echo "tests rc=$trc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/tests.log"
  [ "$trc" != 0 ] && rc=1
fi

if has bench; then
  t0=$(date +%s)
  timeout "$BENCH_TIMEOUT" $PY bench/kernels.py --json "$OUT/kernels.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  bc=${PIPESTATUS[0]}
  echo "bench rc=$bc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/bench.log"
  [ "$bc" != 0 ] && rc=1
fi
if has e2e; then
  t0=$(date +%s)
  timeout "${E2E_TIMEOUT:-540}" $PY bench/e2e.py --json "$OUT/e2e.json" ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.log"
  ec=${PIPESTATUS[0]}
  echo "e2e rc=$ec in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/e2e.log"
  [ "$ec" != 0 ] && rc=1
fi
exit $rc
