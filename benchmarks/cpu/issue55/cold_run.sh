#!/bin/bash
# A cold first launcher run (a fresh JAX compile cache) on the tiny demo pair, 8 inputs.
# usage: benchmarks/cpu/issue55/cold_run.sh GAMMA   (GAMMA: "'auto'" or 4), from the repo root
gamma=$1
cache=$(mktemp -d); out=$(mktemp -d)/out
start=$(date +%s.%N)
JAX_PLATFORMS=cpu JAX_COMPILATION_CACHE_DIR=$cache .venv/bin/python -m experiments.run \
  --gin_file=configs/pairs/tiny_demo.gin --gin_file=configs/tasks/local_file.gin \
  --gin.INPUT_FILE="'benchmarks/cpu/issue55/inputs.jsonl'" --gin.GAMMA="$gamma" \
  --output_dir=$out > $out.log 2>&1
echo "GAMMA=$gamma rc=$? seconds=$(echo "$(date +%s.%N) - $start" | bc) (log: $out.log)"
rm -rf $cache
