#!/usr/bin/env bash
# The GPU checks with the real plugin, on one GPU machine with no network (about 6-8
# minutes on one H200; each step has a time limit):
#   1. build Shoal in place with the machine's python3/torch and its system MPI (MPICXX
#      or MPI_HOME if set, else the mpicxx on PATH), nvcc and the nvidia-nccl wheel, and
#      check that 2 ranks allreduce; if that fails and .whl/mpich-*.whl was carried along,
#      the same with MPICH from that wheel;
#   2. shoalrun --check-build (plugin, NCCL, CUDA-aware MPI);
#   3. pytest tests/gpu (kernels vs torch; 4 ranks sharing the GPU through MPI, staged and,
#      if the MPI is CUDA-aware, direct: every op in float32/bfloat16, stream race 100x;
#      NCCL with one rank);
#   4. benchmarks/gpu_kernels.py (combine vs device-to-device copy bandwidth, target >= 0.8);
#   5. benchmarks/gpu_neighbor.py at 4 ranks, staged and direct: neighbor_allreduce
#      latency and bandwidth at 4 KiB, 1 MiB, 64 MiB.
# Prints a summary. Logs go to $OUT (or /tmp/shoal-gpu). Usage: bash tests/gpu/run_on_device.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=$(command -v "${PYTHON:-python3}")  # absolute: the ranks run the same interpreter
[ -n "$PY" ] || { echo "no ${PYTHON:-python3} here"; exit 1; }
LOGS=${OUT:-/tmp/shoal-gpu}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
command -v nvcc && nvcc --version | tail -1
env | grep -E "^(CC|CXX|CFLAGS|CXXFLAGS|LDFLAGS|LD_LIBRARY_PATH|LD_PRELOAD)=" || true

# Each step has a time limit, so one hang cannot eat the whole device lease.
build() {  # build in place with the MPI named by MPICXX or MPI_HOME; the log goes to $LOGS/build.log
  echo "== build (MPICXX=${MPICXX:-} MPI_HOME=${MPI_HOME:-} SHOAL_CUDA_ARCHS=$SHOAL_CUDA_ARCHS)"
  local start=$SECONDS
  rm -rf build
  if ! timeout 240 "$PY" -m pip install -v --no-deps --no-build-isolation -e . >>"$LOGS/build.log" 2>&1; then
    tail -30 "$LOGS/build.log"; echo "BUILD FAILED"; return 1
  fi
  grep -E "Shoal: " "$LOGS/build.log" | head -3
  echo "built in $((SECONDS - start)) s with $(${CXX:-c++} --version | head -1); libshoal.so needs:" \
    $(ldd shoal/libshoal.so | grep -oE "lib(stdc\+\+|mpi)[^ ]*" | sort -u)
}
smoke() {  # two ranks meet and allreduce: the MPI launches and works here
  timeout 60 "$PY" -m shoal.launcher.run -np 2 "$PY" -c \
    "import numpy as np, shoal; shoal.init(); print('smoke', shoal.allreduce(np.ones(4), name='s', op=shoal.Sum)[0])" \
    >>"$LOGS/smoke.log" 2>&1 && grep -q "smoke 2.0" "$LOGS/smoke.log"
}
export SHOAL_CUDA_ARCHS=${SHOAL_CUDA_ARCHS:-90}  # the H200 only: half the nvcc time
: >"$LOGS/smoke.log"; : >"$LOGS/build.log"
if [ -z "${MPI_HOME:-}" ] && [ -z "${MPICXX:-}" ]; then
  for w in mpicxx mpic++ mpiCC; do
    if command -v "$w" >/dev/null; then export MPICXX=$(command -v "$w"); break; fi
  done
fi
ok=0
if [ -n "${MPI_HOME:-}${MPICXX:-}" ] && build && smoke; then
  ok=1
elif ls .whl/mpich-*.whl >/dev/null 2>&1; then
  # No usable system MPI (no compiler wrapper or headers, or its launch failed): MPICH
  # from the wheel carried along (the default build's MPI), installed under a prefix.
  echo "system MPI not usable here; MPICH from .whl/"; head -12 "$LOGS/smoke.log"
  "$PY" -m pip install -q --no-index --no-deps --ignore-installed --prefix /tmp/mpich .whl/mpich-*.whl
  unset MPICXX CFLAGS CXXFLAGS LDFLAGS; export MPI_HOME=/tmp/mpich CXX=g++
  build && smoke && ok=1
fi
if [ "$ok" != 1 ]; then tail -20 "$LOGS/smoke.log"; echo "NO WORKING BUILD"; exit 1; fi

echo "== check-build"
timeout 60 "$PY" -m shoal.launcher.run --check-build | tee "$LOGS/check-build.txt"

echo "== GPU tests"
# (the fake-device tests run in CI: no need to spend device time on them)
timeout 240 "$PY" -m pytest -v -rA -p no:cacheprovider tests/gpu tests/test_gpu_build.py --ignore=tests/gpu/test_fake_device.py \
  --ignore=tests/gpu/test_gpu_paths.py \
  2>&1 | tee "$LOGS/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== kernel benchmark"
timeout 60 "$PY" benchmarks/gpu_kernels.py 2>&1 | tee "$LOGS/bench.log"

echo "== neighbor_allreduce: staged vs direct (4 ranks on one GPU)"
: >"$LOGS/neighbor.log"
SHOAL_CUDA_AWARE_MPI=0 timeout 90 "$PY" -m shoal.launcher.run -np 4 "$PY" benchmarks/gpu_neighbor.py 2>&1 | tee -a "$LOGS/neighbor.log"
if grep -q "^CUDA-aware MPI: yes" "$LOGS/check-build.txt"; then
  SHOAL_CUDA_AWARE_MPI=1 timeout 90 "$PY" -m shoal.launcher.run -np 4 "$PY" benchmarks/gpu_neighbor.py 2>&1 | tee -a "$LOGS/neighbor.log"
else
  echo "direct: not run (the MPI is not CUDA-aware)" | tee -a "$LOGS/neighbor.log"
fi

echo "== summary"
grep -E "^(CUDA kernels|CUDA plugin|NCCL backend|CUDA-aware MPI|GPU data paths)" "$LOGS/check-build.txt"
grep -E "[0-9]+ (passed|failed|skipped|error)" "$LOGS/gpu-tests.log" | tail -1
grep -hoE "stream race: [0-9]+/100 correct" "$LOGS/gpu-tests.log" | sort | uniq -c
grep -E "ratio \(worst dtype\)" "$LOGS/bench.log"
grep -E "^(path=|direct: not run)" "$LOGS/neighbor.log"
exit "$tests_rc"
