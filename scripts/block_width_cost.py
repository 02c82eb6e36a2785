r"""What the fixed target block width costs on this machine (issue 13).

For the demo target in float32 and bfloat16: the cost curve C(k) (one call
scoring k tokens / one token, `profiling.time_block_calls`) and whole
target-only `generate` at block_width 1 and 8 (batch 1, 40 tokens, median of
7 interleaved repeats).

  python scripts/block_width_cost.py
"""
import statistics, time, jax, specdec_jax as sj
from specdec_jax.tools import profiling
for dtype in ("float32", "bfloat16"):
  pair = sj.load_demo_pair(dtype=dtype); x = pair.heldout_inputs(1); m = pair.target
  ms = profiling.time_block_calls({"t": m}, x, 40, [1, 5, 8], repeats=7)["t"]
  run = {w: (lambda w=w: jax.block_until_ready(sj.generate(m, x, max_decode_steps=40, eos_id=-1, block_width=w).sequences)) for w in (1, 8)}
  for f in run.values(): f()
  t = {w: [] for w in run}
  for _ in range(7):
    for w, f in run.items():
      s = time.perf_counter(); f(); t[w].append(time.perf_counter() - s)
  print(dtype, "C(5) %.2f C(8) %.2f" % (ms[5] / ms[1], ms[8] / ms[1]),
        " ".join("W=%d %.2f ms/token" % (w, statistics.median(v) * 1e3 / 40) for w, v in t.items()))
