#!/usr/bin/env bash
# Issue 31: what the persistent compilation cache saves, cold against warm, on this machine.
# A tiny launcher run (the trained decoder-only demo pair, one --prompt) and `make demo`:
#   cold: a fresh, empty cache directory (the first run on a new machine; for the demo also
#         the first build of act 2's scaled pairs, unless ~/.cache/specdec_jax/scaled_pairs
#         already holds them)
#   warm: the same command again with that directory (every later run)
#   off:  SPECDEC_JAX_CACHE= (every run compiles, as before issue 31; scaled pairs cached)
# Each run gets a fresh output directory, so the launcher decodes everything each time.
# Usage: scripts/compile_cache_timings.sh [OUT_DIR] [--no-demo]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/compile_cache_timings}
rm -rf "$OUT" && mkdir -p "$OUT"
PY=.venv/bin/python
export JAX_PLATFORMS=cpu
seconds() { local start=$(date +%s.%N); "$@" > "$OUT/last.log" 2>&1; echo "$(date +%s.%N) - $start" | bc; }

launch() {  # $1: output dir
  $PY -m experiments.run --pair=local \
    --gin.TARGET_CHECKPOINT="'demo_pair_decoder_only/target'" \
    --gin.DRAFT_CHECKPOINT="'demo_pair_decoder_only/draft'" \
    --gin.VOCABULARY="'demo_pair_decoder_only/tokenizer.model'" --gin.MAX_DECODE_STEPS=32 \
    --prompt="def fibonacci(n):" --output_dir="$1"
}

echo "| what | cache | seconds |" | tee "$OUT/timings.md"
echo "|---|---|---|" | tee -a "$OUT/timings.md"
for mode in cold warm off; do
  case $mode in
    off) export SPECDEC_JAX_CACHE= ;;
    cold) rm -rf "$OUT/cache"; export SPECDEC_JAX_CACHE="$OUT/cache" ;;
    warm) export SPECDEC_JAX_CACHE="$OUT/cache" ;;
  esac
  t=$(seconds launch "$OUT/launch_$mode")
  echo "| launcher, one prompt, decoder-only demo pair | $mode | $t |" | tee -a "$OUT/timings.md"
done
if [[ "${2:-}" != "--no-demo" ]]; then
  for mode in cold warm off; do
    case $mode in
      off) export SPECDEC_JAX_CACHE= ;;
      cold) rm -rf "$OUT/demo_cache"; export SPECDEC_JAX_CACHE="$OUT/demo_cache" ;;
      warm) export SPECDEC_JAX_CACHE="$OUT/demo_cache" ;;
    esac
    t=$(seconds $PY -m experiments.demo --pair=both --memory_budget_gb=4)
    cp "$OUT/last.log" "$OUT/demo_$mode.log"
    echo "| make demo (both acts, both pairs) | $mode | $t |" | tee -a "$OUT/timings.md"
  done
fi
