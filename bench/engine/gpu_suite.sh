#!/usr/bin/env bash
# The engine's GPU checks in one go, for a CUDA machine with torch, transformers, triton, peft and pytest:
# the CUDA unit tests (and the device-parametrised LoRA/PEFT and sampling tests), then the GPU benchmark
# (fp32 greedy equality check + engine vs HF generate, SmolLM2-135M and Llama-3.2-1B shapes, 32/128/256
# streams, fixed and mixed lengths). Logs and JSON go to $OUT (default bench/results/gpu-<date>).
#   bash bench/engine/gpu_suite.sh            # from the repository root
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results/gpu-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia-smi.csv" 2>&1
$PY -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee "$OUT/versions.txt"
timeout "${TEST_TIMEOUT:-150}" $PY -m pytest -q --noconftest -p no:cacheprovider -x \
  tests/engine/test_engine_cuda.py tests/engine/test_sampling.py tests/engine/test_engine_lora_peft.py \
  2>&1 | tee "$OUT/pytest-cuda.log"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest-cuda.log"
timeout "${BENCH_TIMEOUT:-400}" $PY -m bench.engine.gpu_bench --out "$OUT/engine-gpu.json" ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/gpu-bench.log"
echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu-bench.log"
grep '"system": "ratio"\|"system": "check"' "$OUT/gpu-bench.log" | cut -c1-300
