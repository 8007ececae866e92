#!/usr/bin/env bash
# One GPU round in one call (device tool): environment, build the CUDA kernels, the `cuda` tests, the kernel
# benchmark. Logs and JSON go to $OUT (default ./gpu_out). Run from the repository root:
#   bash bench/gpu_round.sh            # everything
#   STAGES="build bench" bash bench/gpu_round.sh
#   STAGES="e2e" E2E_ARGS="--parts decode --layers 42 --batches 1 --decode-variants stock,g4ops" bash bench/gpu_round.sh
#   STAGES="build sampling serve" bash bench/gpu_round.sh   # issue 16's and 17's benchmarks (each under 10 min)
#   STAGES="build flex" FLEX_ARGS="--kinds full" bash bench/gpu_round.sh   # flex kernel options vs g4ops attention
#   STAGES="build test profile" TEST_PATHS="tests/test_gelu_tanh_mul.py" KEEP="tests.log profile.json" \
#     PROFILE_ARGS="--layers 42 --parts train --attention --train-modes compiled --variants g4ops \
#     --compile-mode reduce-overhead --top 60 --host-top 5" bash bench/gpu_round.sh   # tests, then a step's kernels
#   STAGES="env lorafused" bash bench/gpu_round.sh   # the fused LoRA u/dB prototype vs today's split pair (no build)
#   STAGES="build e2e-each" E2E_VARIANTS="g4ops-compile liger stock-compile" E2E_ARGS="--parts train --seqs 2048" \
#     bash bench/gpu_round.sh                         # compared train rows, each variant in its own process
#   E2E_PARALLEL=1 STAGES="build e2e-each" ...        # the same, compiled side by side and timed one at a time
#   STAGES="build e2e-each" E2E_AFTER_VARIANTS="stock g4ops g4ops+G4OPS_LORA_EAGER_LINEAR=op liger" \
#     E2E_REFERENCE=stock \
#     E2E_ARGS="--parts train --seqs 2048 --g4ops-attention --optimizers none --lora 16" bash bench/gpu_round.sh
#                                                     # eager rows (HF Trainer's default); +NAME=VALUE: g4ops' switches
#   E2E_PARALLEL=1 STAGES="build e2e-each" E2E_VARIANTS="g4ops-compile stock-compile" E2E_AFTER_VARIANTS=liger \
#     E2E_LAYOUTS="packed padded" E2E_ARGS="--parts train --seqs 2048 --g4ops-attention --optimizers none --lora 16" \
#     bash bench/gpu_round.sh                         # two layouts in one call (an H200 only: 105 GiB of peaks)
# Wheels in .whl/ (ignored: carry it) or .wheels/ are installed into /tmp/site first: the GPU image lacks
# Liger-Kernel and the serve stack (FastAPI, Starlette, uvicorn, pydantic, openai; without them tests/test_serve.py
# is not collected). Fetched here for the image's Python 3.12 (7.3 MB once torch and what the image has are dropped):
#   pip download -d .whl --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 fastapi uvicorn pydantic openai \
#     liger-kernel==0.8.5 && rm .whl/{torch,triton,nvidia_,sympy,mpmath,networkx,jinja2,markupsafe,fsspec}* \
#     .whl/{filelock,setuptools}*
# The kernel build takes 70-90 s on each fresh machine. SAVE_BUILD=1 copies the built library to $OUT, gzipped (the
# library was 20.4 MB on 2026-12-05, past the 16 MiB a returned file may have); put the file that comes back into
# .prebuilt/ here (ignored) and carry ".prebuilt": the next call's build stage then loads it (g4ops/ops/_build.py: its
# name is the build's tag, so it is used only for the same sources, torch, CUDA and arch). bench/prebuild.py builds
# the same library without a GPU, under the image's torch (2.11.0+cu130) and arch (9.0a), in about 3 minutes.
# KEEP (file globs, space-separated): only the round's files that match come back in $OUT (a device call returns at
# most 8; session 55 lost a kernel table to that limit); the rest stays in a scratch folder on the machine:
#   KEEP="e2e-*.json e2e-table.md lora-fold.json tests.log" STAGES="build lorafold e2e-each test" ...
set -u
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
if [ -n "${KEEP:-}" ]; then
  KEPT_OUT=$OUT OUT=$(mktemp -d)
  keep() {  # on exit: the files KEEP names, from the scratch folder to the folder that comes back
    local glob file
    for glob in $KEEP; do
      for file in "$OUT"/$glob; do [ -f "$file" ] && cp "$file" "$KEPT_OUT/"; done
    done
    ls "$KEPT_OUT"
  }
  trap keep EXIT
fi
STAGES=${STAGES:-"env build test bench"}
# the whole cuda suite (1642 tests) took 542 s with -n 12 on the H200 (2026-12-02, session 14); with the 75 s build
# that is past a 600 s call: build in one call (STAGES="env build"), test in the next while the machine is warm
TEST_TIMEOUT=${TEST_TIMEOUT:-585}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-360}
export PYTHONUNBUFFERED=1
# the image's own setting is 9.0a (the tag of session 55's library says so); the same here, so that a library built
# by bench/prebuild.py matches whether or not the machine sets it
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-16}
PY=${PY:-python3}
wheels=$(ls .whl/*.whl .wheels/*.whl 2>/dev/null || true)
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086  # one path per word
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
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
  cache=$($PY -c "from g4ops.ops._build import cache_dir; print(cache_dir())")
  for built in .prebuilt/g4ops_cuda_*.so.gz; do
    [ -f "$built" ] || continue
    tag=$(basename "$built" .so.gz); tag=${tag#g4ops_cuda_}
    mkdir -p "$cache/$tag" && gunzip -c "$built" > "$cache/$tag/g4ops_cuda_$tag.so"
  done
  if $PY -m g4ops build --help >/dev/null 2>&1; then
    $PY -m g4ops build --verbose 2>&1 | tee "$OUT/build.log"; brc=${PIPESTATUS[0]}
  else
    $PY -c "import g4ops; print(g4ops.build_kernels(verbose=True))" 2>&1 | tee "$OUT/build.log"; brc=${PIPESTATUS[0]}
  fi
  echo "build rc=$brc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/build.log"
  if [ "$brc" != 0 ]; then echo "BUILD FAILED"; tail -60 "$OUT/build.log"; exit 1; fi
  if [ "${SAVE_BUILD:-0}" = 1 ]; then  # the libraries built in this call (not those unpacked from .prebuilt/)
    for lib in "$cache"/*/g4ops_cuda_*.so; do
      [ -f ".prebuilt/$(basename "$lib").gz" ] || gzip -9 -c "$lib" > "$OUT/$(basename "$lib").gz"
    done
    ls -l "$OUT"/g4ops_cuda_*.so.gz 2>/dev/null
  fi
fi

# stage NAME TIMEOUT CMD...: run CMD under a timeout, log to $OUT/NAME.log, remember a failure in rc
stage() {
  local name=$1 limit=$2 t0 code
  shift 2
  t0=$(date +%s)
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  code=${PIPESTATUS[0]}
  echo "$name rc=$code in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/$name.log"
  [ "$code" != 0 ] && rc=1
  return 0
}

# TEST_PATHS (default tests/): the files to run. The whole suite passed 1624 of its 1644 cuda items within 585 s in
# session 15 and was cut there: run it in two calls on the warm machine, the kernel files, then the rest:
#   KERNELS="tests/test_cuda_kernels.py tests/test_ops.py tests/test_decode_attention.py tests/test_adamw.py"
#   STAGES=test TEST_PATHS="$KERNELS" bash bench/gpu_round.sh
#   STAGES=test TEST_PATHS="$(ls tests/test_*.py | grep -v -F -x "$(echo $KERNELS | tr ' ' '\n')")" bash bench/gpu_round.sh
# PYTEST_ARGS (default: the whole suite on 12 workers): keep -v, so that a suite cut by TEST_TIMEOUT still names
# each failure as it happens (-q would cancel it); the reasons are printed only when the session ends, so rerun a
# named failure alone (with --timeout N: pytest-timeout is on the image) to read it. PYTEST_K: a -k expression
# (PYTEST_ARGS is split on spaces, so quotes inside it do not group words).
# shellcheck disable=SC2086  # the *_ARGS variables are word lists on purpose
has test && stage tests "$TEST_TIMEOUT" $PY -m pytest -m cuda -rf -p no:cacheprovider ${PYTEST_ARGS:--n 12 -v --tb=short} \
  ${PYTEST_K:+-k "$PYTEST_K"} ${TEST_PATHS:-tests/}
# shellcheck disable=SC2086
has bench && stage bench "$BENCH_TIMEOUT" $PY bench/kernel_bench.py --json "$OUT/kernels.json" ${BENCH_ARGS:-}
# shellcheck disable=SC2086
has e2e && stage e2e "${E2E_TIMEOUT:-540}" $PY bench/e2e.py --json "$OUT/e2e.json" ${E2E_ARGS:-}
# e2e-each: one process per train variant of E2E_VARIANTS (space-separated), as the compared rows are taken (no
# compile caches or allocator state shared between variants); each writes $OUT/e2e-VARIANT.json. E2E_LAYOUTS (e.g.
# "packed padded"): one process per variant and layout (`--layout L` added to E2E_ARGS), writing
# $OUT/e2e-L-VARIANT.json. E2E_PARALLEL=1 starts them side by side: they compile together and time one at a time
# (bench/e2e.py's TimingTurns), so a call pays the longest compile instead of the sum; their models must fit on the
# GPU together, and each E2E_TIMEOUT then covers the wait for the others' turns. E2E_AFTER_VARIANTS run afterwards,
# one process at a time: eager Liger compiles nothing, so it gains nothing from overlapping and its peak would add to
# the others' (two layouts of g4ops and stock compile LoRA side by side: peaks of 21.5 + 23.2 + 28.6 + 31.8 = 105 GiB,
# session 36; an H200 only).
if has e2e-each && [ -n "${E2E_VARIANTS:-}${E2E_AFTER_VARIANTS:-}" ]; then
  layouts=${E2E_LAYOUTS:-"-"}  # "-": E2E_ARGS' own layout
  n_parallel=$(( $(wc -w <<< "${E2E_VARIANTS:-}") * $(wc -w <<< "$layouts") ))
  turns=$(mktemp -d)  # fresh for each run: TimingTurns counts the files in it
  e2e_each() {  # e2e_each PARALLEL VARIANT[+NAME=VALUE...]...: one e2e.py per variant and layout
    local parallel=$1 word variant layout name extra switches switch
    shift
    for word in "$@"; do
      # g4ops+G4OPS_LORA_COMPILE=0: the variant in a process with that environment (e2e.py's rows name it), its
      # files named e2e-g4ops-G4OPS_LORA_COMPILE-0 (only letters, digits, '.', '_' and '-' come back from $OUT)
      variant=${word%%+*} switches=()
      [ "$word" != "$variant" ] && IFS=+ read -r -a switches <<< "${word#*+}"
      for layout in $layouts; do
        name=$variant extra=""
        for switch in "${switches[@]}"; do name="$name-${switch//=/-}"; done
        [ "$layout" != - ] && name=$layout-$name extra="--layout $layout"
        [ "$parallel" = 1 ] && extra="$extra --timing-turns $turns --timing-parties $n_parallel"
        # shellcheck disable=SC2086
        cmd=(stage "e2e-$name" "${E2E_TIMEOUT:-540}" env "${switches[@]}" $PY bench/e2e.py
             --json "$OUT/e2e-$name.json" --variants "$variant" ${E2E_ARGS:-} $extra)
        if [ "$parallel" = 1 ]; then "${cmd[@]}" > /dev/null & else "${cmd[@]}"; fi
      done
    done
    wait  # (stage's rc of a background run stays in its subshell: each log's "rc=" line says it)
  }
  # shellcheck disable=SC2086
  e2e_each "${E2E_PARALLEL:-0}" ${E2E_VARIANTS:-}
  # shellcheck disable=SC2086
  e2e_each 0 ${E2E_AFTER_VARIANTS:-}
  # ... and their rows in one table against E2E_REFERENCE's (bench/e2e.py --merge), also in $OUT/e2e-table.md
  $PY bench/e2e.py --merge "$OUT"/e2e-*.json --merge-reference "${E2E_REFERENCE:-stock-compile}" 2>&1 \
    | tee "$OUT/e2e-table.md"
fi
# profile: bench/profile_steps.py with PROFILE_ARGS, its JSON in $OUT/profile.json (the kernel table and host phases
# of a step; KEEP="profile.json ..." to bring it back beside the other stages' files)
# shellcheck disable=SC2086
has profile && stage profile "${PROFILE_TIMEOUT:-540}" $PY bench/profile_steps.py --json "$OUT/profile.json" \
  ${PROFILE_ARGS:-}
# lorafold: bench/lora_fold.py, the two orders of folding LoRA's low-rank products into the base GEMM (G4OPS_LORA_FOLD)
has lorafold && stage lorafold 120 $PY bench/lora_fold.py --json "$OUT/lora-fold.json"
# shellcheck disable=SC2086
has lorafused && stage lorafused "${LORAFUSED_TIMEOUT:-540}" $PY bench/lora_grad_fused.py \
  --json "$OUT/lora-grad-fused.json" ${LORAFUSED_ARGS:-}
# shellcheck disable=SC2086
has flex && stage flex "${FLEX_TIMEOUT:-540}" $PY bench/flex_options.py --json "$OUT/flex.json" ${FLEX_ARGS:-}
# shellcheck disable=SC2086
has sampling && stage sampling "${SAMPLING_TIMEOUT:-540}" $PY bench/sampling.py --out "$OUT/sampling.json" \
  ${SAMPLING_ARGS:-}
# shellcheck disable=SC2086
has serve && stage serve "${SERVE_TIMEOUT:-540}" $PY bench/serve.py --shape e4b --out "$OUT/serve.json" \
  $($PY -c "import matplotlib" 2>/dev/null && echo --plot "$OUT/serve.png") ${SERVE_ARGS:-}
exit $rc
