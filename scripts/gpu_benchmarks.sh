#!/usr/bin/env bash
# The paper's setting on one GPU, in at most ~6 minutes (issue 15): an
# XXL-shaped target that is the shipped 9.7M demo target EMBEDDED function-
# preservingly in the T5 1.1 XXL shape (same function, XXL cost; not a trained
# 11B model), against transformers on the same device, C(k), c of the demo and
# T5-small-shaped drafts, and the demo drafts' real acceptance at that cost.
# See scripts/gpu_benchmarks.py. Results: $OUT (default ./gpu_results):
# hf.json, ours.json, methods.json, features.json, gpu_benchmarks.json, gpu_benchmarks.md, logs;
# the evaluation harness's tables in evaluate/ (its summary in evaluate.json).
#
#   scripts/gpu_benchmarks.sh              # on the accelerator
#   scripts/gpu_benchmarks.sh --dry_run    # CPU, tiny shapes (tests/test_gpu_benchmarks.py)
#
# Needs jax for the accelerator, torch + transformers (the `parity` extra), and
# gin-config, which specdec_jax imports. The lent H200 machine lacks gin-config
# only; this script then installs a wheel carried in .whl/ (here, once:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl gin-config==0.5.0
# and name .whl in the device call's carry).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_results}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The parts run one after another in their own processes; without
# preallocation each takes only what it uses.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if ! "$PY" -c "import gin" 2>/dev/null; then
  if compgen -G ".whl/gin_config-*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gin_site \
      .whl/gin_config-*.whl
    export PYTHONPATH="/tmp/gin_site:$PYTHONPATH"
  else
    echo "gpu_benchmarks.sh: this Python lacks gin-config (specdec_jax imports it); carry" \
         "its wheel in .whl/ (see the header of this script)" >&2
    exit 2
  fi
fi
mkdir -p "$OUT"
"$PY" -c "import jax; print(jax.devices())" | tee "$OUT/ours.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null \
  | tee -a "$OUT/ours.log" || true
"$PY" scripts/gpu_benchmarks.py --part=hf --output_dir="$OUT" "$@" 2>&1 | tee "$OUT/hf.log" \
  || echo "gpu_benchmarks.sh: the transformers part failed (see $OUT/hf.log)" >&2
"$PY" scripts/gpu_benchmarks.py --part=ours --output_dir="$OUT" "$@" 2>&1 | tee -a "$OUT/ours.log"
# Issue 22: block verification and token trees at W = 8, 16 (its own process).
"$PY" scripts/gpu_benchmarks.py --part=methods --output_dir="$OUT" "$@" 2>&1 \
  | tee "$OUT/methods.log" \
  || echo "gpu_benchmarks.sh: the methods part failed (see $OUT/methods.log)" >&2
# Issue 23: the demo feature head embedded with the target, chain and trees.
"$PY" scripts/gpu_benchmarks.py --part=features --output_dir="$OUT" "$@" 2>&1 \
  | tee "$OUT/features.log" \
  || echo "gpu_benchmarks.sh: the features part failed (see $OUT/features.log)" >&2
# Issue 33: throughput at any batch size at the XXL shape: target-only, fixed gamma and
# gamma='auto', fixed batches against slots (sj.generate_many), batch 1-64, bf16.
THROUGHPUT_FLAGS=(--pairs=scaled --scaled_shape=t5_1_1_xxl --batch_sizes=1,4,16,64
                  --temperatures=0 --num_inputs=64 --inputs_per_slot=2 --dtype=bfloat16)
if [[ " $* " == *" --dry_run "* ]]; then THROUGHPUT_FLAGS=(--pairs=scaled --dry_run
                                                           --batch_sizes=1,4 --temperatures=0); fi
"$PY" scripts/throughput.py "${THROUGHPUT_FLAGS[@]}" --output_json="$OUT/throughput.json" \
  2>&1 | tee "$OUT/throughput.log" \
  || echo "gpu_benchmarks.sh: the throughput part failed (see $OUT/throughput.log)" >&2
# Issue 34: C(k) for k = 1..16 of Mixtral- and DeepSeek-V3-layout targets beside dense ones
# of their active size, batch 1-16, and the best gamma each predicts.
MOE_FLAGS=(--batch_sizes=1,4,16)
if [[ " $* " == *" --dry_run "* ]]; then MOE_FLAGS=(--small --max_k=3 --repeats=2); fi
"$PY" scripts/moe_cost_curve.py "${MOE_FLAGS[@]}" --output_json="$OUT/moe_cost_curve.json" \
  2>&1 | tee "$OUT/moe_cost_curve.log" \
  || echo "gpu_benchmarks.sh: the MoE cost-curve part failed (see $OUT/moe_cost_curve.log)" >&2
# The evaluation harness (experiments.evaluate) on the T5 pair's mini-benchmark, the target
# grown to the XXL shape and the 'small' draft and PARD's model to t5_1_1_small (--scale_to),
# every method, greedy, batch 1, --chat_template=plain: $OUT/evaluate/results.{json,md}, the
# plot, and evaluate.json. Sized for the device budget: the three categories whose prompts
# share one width (one compile per method), 2 questions each, stopped after
# --evaluate_timeout seconds (150; see scripts/gpu_benchmarks.py), the finished records
# then summarised.
"$PY" scripts/gpu_benchmarks.py --part=evaluate --output_dir="$OUT" "$@" 2>&1 \
  | tee "$OUT/evaluate.log" \
  || echo "gpu_benchmarks.sh: the evaluate part failed (see $OUT/evaluate.log)" >&2
"$PY" scripts/gpu_benchmarks.py --part=report --output_dir="$OUT" "$@"
