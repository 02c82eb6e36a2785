r"""Does a row's greedy output depend on the rows decoded beside it?

Decodes each of N held-out demo inputs twice with the target (and with the
speculative loop): alone (batch 1) and as one row of a batch of `--batch_size`
(the row plus neighbours drawn from the other inputs), in `--dtype` (bfloat16
by default: where rounding differences show), and reports the fraction of
rows whose tokens are identical in both settings, at the default block width,
at width 1, speculatively, and with `generate(..., batch_invariant=True)` (with
the time that option costs a batch).

  python scripts/batch_invariance.py --num_inputs=32 --batch_size=16 --dtype=bfloat16 \
      --output=results/batch_invariance.json
"""

import datetime
import json
import platform
import statistics
import time

from absl import app
from absl import flags
import jax
import numpy as np

import specdec_jax as sj
from specdec_jax.core import decoding
from specdec_jax.results import write_json_atomic

NUM_INPUTS = flags.DEFINE_integer("num_inputs", 32, "Held-out inputs checked.")
BATCH = flags.DEFINE_integer("batch_size", 16, "Batch each row is also decoded in.")
DTYPE = flags.DEFINE_string("dtype", "bfloat16", "Compute dtype of the demo pair.")
GAMMA = flags.DEFINE_integer("gamma", 4, "Drafted tokens for the speculative rows.")
OUTPUT = flags.DEFINE_string("output", "", "JSON result path (atomic write).")


def invariance(decode, inputs: np.ndarray, batch: int) -> dict:
  """Fraction of rows decoded identically alone and inside a batch of `batch`."""
  n = len(inputs)
  alone = np.concatenate([np.asarray(decode(inputs[i:i + 1])) for i in range(n)])
  # Row i sits at position i % batch among the next inputs (wrapping around),
  # so it meets different neighbours and different slots.
  in_batch = np.zeros_like(alone)
  for start in range(0, n, batch):
    rows = [(start + j) % n for j in range(batch)]
    out = np.asarray(decode(inputs[rows]))
    for j, row in enumerate(rows[:min(batch, n - start)]):
      in_batch[row] = out[j]
  same = (alone == in_batch).all(axis=1)
  return dict(identical_rows=int(same.sum()), rows=n, rate=float(same.mean()))


def _median_seconds(fn, repeats: int = 3) -> float:
  jax.block_until_ready(fn())  # Compile.
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv):
  del argv
  pair = sj.load_demo_pair(dtype=DTYPE.value)
  target, draft = pair.target, pair.drafts["small"]
  inputs = pair.heldout_inputs(NUM_INPUTS.value)
  steps = pair.max_decode_steps
  result = dict(
      date=datetime.date.today().isoformat(), machine=platform.processor() or platform.machine(),
      backend=jax.default_backend(), jax=jax.__version__, dtype=DTYPE.value,
      batch_size=BATCH.value, max_decode_steps=steps,
      block_width=decoding.DEFAULT_BLOCK_WIDTH,
      target_only=invariance(lambda x: sj.generate(target, x, max_decode_steps=steps).sequences,
                             inputs, BATCH.value),
      target_only_width_1=invariance(
          lambda x: sj.generate(target, x, max_decode_steps=steps, block_width=1).sequences,
          inputs, BATCH.value),
      speculative=invariance(
          lambda x: sj.generate(target, x, max_decode_steps=steps, draft=draft,
                                gamma=GAMMA.value).sequences, inputs, BATCH.value))
  # The option: every row through the batch-1 program. Invariant by
  # construction; its price is the batch's parallelism, timed here.
  result["target_only_batch_invariant_option"] = invariance(
      lambda x: sj.generate(target, x, max_decode_steps=steps, batch_invariant=True).sequences,
      inputs, BATCH.value)
  batch = inputs[:BATCH.value]
  result["batch_seconds"] = {
      name: _median_seconds(lambda: sj.generate(target, batch, max_decode_steps=steps,
                                                batch_invariant=flag).sequences)
      for name, flag in (("batched", False), ("batch_invariant", True))}
  print(json.dumps(result, indent=1))
  if OUTPUT.value:
    write_json_atomic(OUTPUT.value, result)


if __name__ == "__main__":
  app.run(main)
