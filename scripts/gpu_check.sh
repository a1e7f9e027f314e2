#!/usr/bin/env bash
# On a machine with an NVIDIA GPU, from anywhere in the repo: install DeepInfer, run the Triton
# kernel tests compiled for the device (no interpreter), model-sized shapes included, in
# float32/float16/bfloat16 against their torch references, then the engine on the GPU against
# the CPU (greedy tokens, tensor parallelism over two GPUs when there are two, batch-1 and
# 64-concurrent speed), and print one summary.
# Takes a minute or two (kernel compilation dominates). Exit status: 0 only if all passed.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
# The machine brings its own CUDA torch (and triton): use the python3 that has it (it may be a
# venv of its own, whose packages a --system-site-packages venv would not see), else a venv over
# the system's. Never `make install` here: the Makefile pins the CPU torch used without a GPU.
PY=${PY:-}
if [[ -z $PY ]] && python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    PY=python3
elif [[ -z $PY ]]; then
    PY=.venv/bin/python
    [[ -x $PY ]] || python3 -m venv --system-site-packages .venv
fi

echo "== GPUs"
nvidia-smi -L

"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} in .venv sees no CUDA device"
import triton
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
PY

echo "== install"
pip_log=$(mktemp)
if ! "$PY" -m pip install -q -e '.[test]' >"$pip_log" 2>&1; then
    # Offline machines: the kernel tests need only torch, triton, numpy and pytest.
    echo "pip install failed (offline?); running from the source tree. Last lines:"
    tail -n 3 "$pip_log"
fi
"$PY" -c "import pytest, numpy" || { echo "gpu_check: FAIL (pytest/numpy missing)"; exit 1; }
"$PY" -c "import torch; assert torch.cuda.is_available(), 'pip replaced the CUDA torch'"

echo "== Triton kernels on the GPU"
report=$(mktemp)
unset TRITON_INTERPRET
set +e
# --confcutdir: only this folder's conftest, so the run needs none of the engine's dependencies.
DEEPINFER_KERNEL_REPORT=$report PYTHONPATH=$PWD timeout 480 \
    "$PY" -m pytest -q -p no:cacheprovider --confcutdir=tests/kernels/triton tests/kernels/triton
status=$?
set -e

# The engine itself: greedy tokens on the GPU (and over two GPUs with tensor parallelism)
# against the CPU's, and its speed (scripts/gpu_engine_check.py). The model: the default one
# when prepared, else random weights shaped by GPU_CHECK_MODEL_DIR (default .gpu-model: a
# config.json and tokenizer files carried to a machine that reaches no model hub).
echo "== engine on the GPU"
engine_log=$(mktemp)
engine_status=0
model_dir=${GPU_CHECK_MODEL_DIR:-.gpu-model}
if ! "$PY" -c "import zmq, msgspec, uvloop, starlette, safetensors, tokenizers" 2>/dev/null; then
    echo "engine check skipped: the engine's packages are missing (offline install failed)"
else
    if "$PY" -c "from engine import envs; from engine.config import DEFAULT_MODEL_NAME as m; \
assert any((envs.cache_dir() / m).glob('*.safetensors'))" 2>/dev/null; then
        model_args=(--model default)
    elif [[ -f $model_dir/config.json ]]; then
        model_args=(--random-from "$model_dir")
    else
        model_args=()
    fi
    if [[ ${#model_args[@]} -eq 0 ]]; then
        echo "engine check skipped: no default model and no $model_dir/config.json"
    else
        set +e
        PYTHONPATH=$PWD timeout 900 "$PY" scripts/gpu_engine_check.py "${model_args[@]}" \
            --devices cpu,cuda 2>&1 | tee "$engine_log" | grep -v " INFO "
        engine_status=${PIPESTATUS[0]}
        set -e
    fi
fi

echo "== summary"
cat "$report" 2>/dev/null || true
grep -E "^(greedy|speed) " "$engine_log" 2>/dev/null || true
[[ $status -eq 0 ]] && status=$engine_status
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
verdict=$([[ $status -eq 0 ]] && echo PASS || echo "FAIL (pytest exit $status)")
echo "gpu_check: $verdict on $gpu in $((SECONDS - start)) s"
exit "$status"
