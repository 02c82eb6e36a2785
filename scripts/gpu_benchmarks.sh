#!/usr/bin/env bash
# GPU rows for BENCHMARKS.md, in a few minutes on one accelerator.
#
# Needs a Python with jax for the accelerator (e.g. jax[cuda12]) and this
# package installed (`pip install -e .[test,parity]`). Weights default to
# bfloat16 off CPU (benchmark.py --dtype). Results land in $OUT (default
# ./gpu_results): one JSON per table plus the printed tables in gpu.log.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_results}"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
"$PY" -c "import jax; print(jax.devices())" | tee "$OUT/gpu.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/gpu.log" || true

# (a) T5-base-shaped target, T5-small-shaped / tiny / perturbed-copy drafts, full vocabulary.
"$PY" scripts/benchmark.py --target=t5_1_1_base --draft=t5_1_1_small,tiny_draft \
  --draft_noise=0.1 --batch_sizes=1 --gammas=3,5,7 --temperatures=0,1 \
  --max_decode_steps=128 --repeats=5 --output_json="$OUT/base.json" 2>&1 | tee -a "$OUT/gpu.log"

# (c) batch scaling, T5-large-shaped target with a perturbed-copy draft and a small draft.
"$PY" scripts/benchmark.py --target=t5_1_1_large --draft=t5_1_1_small --draft_noise=0.1 \
  --batch_sizes=1,4,16 --gammas=4 --temperatures=0 --max_decode_steps=128 --repeats=5 \
  --output_json="$OUT/batch.json" 2>&1 | tee -a "$OUT/gpu.log"

# (b) transformers on the same weights (PyTorch on the GPU only if torch sees it;
# hf_peer runs HF on torch's default device, CPU in the CPU-only wheel).
"$PY" scripts/hf_peer.py --config=t5_1_1_small --draft_noise=0.1 --gamma=4 --new_tokens=64 \
  --repeats=5 --output_json="$OUT/hf_peer.json" 2>&1 | tee -a "$OUT/gpu.log" || \
  echo "hf_peer skipped (parity extra missing?)" | tee -a "$OUT/gpu.log"
