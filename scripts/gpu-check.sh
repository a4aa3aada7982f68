#!/usr/bin/env bash
# The GPU checklist (GPU_CHECKLIST.md) in one call, on a machine with a CUDA GPU:
#   bash scripts/gpu-check.sh [PYTEST_ARGS...]     e.g. -k standby
# 1. installs nbddp from this tree (and, on a machine without network, the wheels
#    carried in .whl/: ipykernel, IPython, jupyter_client, nbclient, nbformat,
#    ipywidgets and what they need; see benchmarks/README.md, "GPU");
# 2. runs the GPU tests (-m gpu): NCCL launches, a kernel that touched CUDA, standby
#    ranks holding no GPU, a session keeping a model on the GPU across notebook cells
#    (--out, an interrupt, a timeout), CUDA tensors crossing, FSDP2, per-rank memory;
# 3. runs benchmarks/bench_gpu.py: cold and warm launches beside torchrun (the warm one
#    split into hand-over, CUDA context, NCCL set-up and user code), conv DDP steps/s,
#    a session's round trip, a 1 GiB CUDA tensor each way.
# Everything it prints is also kept in $OUT (default: a new temp dir); BENCH_ARGS go to
# bench_gpu.py (e.g. BENCH_ARGS="--repeats 2", or "--only training --steps 3000" for one
# part). It takes about 7 minutes on one H100.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation . || exit 1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$OUT_DIR/machine.txt"
status=0
PYTHONUNBUFFERED=1 timeout 300 "$PY" -m pytest -p no:cacheprovider -m gpu -v -rs "$@" \
  tests/test_gpu.py tests/test_gpu_notebook.py 2>&1 | tee "$OUT_DIR/tests.txt" || status=1
PYTHONUNBUFFERED=1 timeout 360 "$PY" benchmarks/bench_gpu.py ${BENCH_ARGS:-} \
  --json "$OUT_DIR/bench_gpu.json" 2>&1 | tee "$OUT_DIR/bench.txt" || status=1
exit $status
