r"""The fused decode step against the reference: operations per decoder layer and step times.

"Reference" is the linen `T5.decode_block` (the T5X-shaped network, one
operation per kernel: the path before issue 15, though it now reads the
head-major cache too; the code from before is timed against this one by
`scripts/decode_speed.py`); "fused" is `families/t5/decode.py`, which
`Model.block_fn` runs. Both are timed in the same process, interleaved repeat
by repeat:

* ops/layer: `hlo_ops.ops_per_layer` (compiled step inside a decode loop,
  programs with 2 and 3 decoder layers differenced);
* step ms: one `decode_block` call scoring k tokens, as `profiling` times it
  (`calls` calls in one jitted loop on a cache half full), k = 1 and 5;
* target-only ms/token: the program `generate` builds for target-only
  decoding (encoder, cache, `temperature_sample` loop), greedy, batch 1,
  `--steps` tokens with EOS disabled, whole call timed.

  JAX_PLATFORMS=cpu python scripts/decode_ops_bench.py --models=demo_target,t5_1_1_small \
    --repeats=7 --output_json=/tmp/decode_ops.json
"""

import functools
import json
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp

import specdec_jax as sj
from specdec_jax import demo_pair
from specdec_jax.core import decoding
from specdec_jax.tools import hlo_ops
from specdec_jax.tools import testing
from specdec_jax.families.t5 import decode as t5_decode
from specdec_jax.families.t5.network import T5
from specdec_jax.results import write_json_atomic

MODELS = flags.DEFINE_list("models", ["demo_target", "t5_1_1_small"],
                           "demo_target (the shipped 9.7M target's shape) or config names.")
REPEATS = flags.DEFINE_integer("repeats", 7, "Timed repeats per measurement (interleaved).")
STEPS = flags.DEFINE_integer("steps", 64, "Tokens per target-only decode.")
# 1: one token per call; 8: decoding.DEFAULT_BLOCK_WIDTH, what `generate` uses.
BLOCK_WIDTHS = (1, 8)
CALLS = flags.DEFINE_integer("calls", 8, "decode_block calls per timed loop.")
ENC_LEN = flags.DEFINE_integer("encoder_length", 32, "Encoder input length.")
COUNT_OPS = flags.DEFINE_bool("count_ops", True, "Also count compiled operations per layer.")
OUTPUT = flags.DEFINE_string("output_json", "", "Write the results here.")


def linen_block_fn(config):
  """params -> the reference `T5.decode_block` callback (what decoding ran before issue 15)."""
  return lambda params: (lambda tokens, positions, cache: T5(config).apply(
      {"params": params}, tokens, positions, cache, method=T5.decode_block))


def fast_block_fn(config, attention=None):
  """params -> the fused `t5_decode` callback (`Model.block_fn` runs attention=None)."""
  return lambda params: t5_decode.block_fn(params, config, attention)


PATHS = {"reference (linen T5.decode_block)": linen_block_fn,
         "fused (t5_decode, attention='dots': CPU default)":
             functools.partial(fast_block_fn, attention="dots"),
         "fused (t5_decode, attention='in_layout': accelerator default)":
             functools.partial(fast_block_fn, attention="in_layout")}


def named_config(name: str, dtype: str = "float32") -> sj.T5Config:
  if name == "demo_target":
    with open(f"{demo_pair.DEFAULT_DIR}/config.json") as f:
      return demo_pair.config_from_json(json.load(f)["models"]["target"]).replace(dtype=dtype)
  return sj.get_config(name, dtype=dtype)


def block_loop(block_fn_for, k: int, calls: int):
  """jit: `calls` block calls of k tokens carrying the cache (as profiling does)."""

  def run(params, cache, positions):
    block_fn = block_fn_for(params)
    tokens = jnp.full((positions.shape[0], k), 2, jnp.int32)

    def body(_, carry):
      cache, total = carry
      logits, cache = block_fn(tokens, positions, cache)
      return cache, total + logits[:, -1, 0]

    return jax.lax.fori_loop(0, calls, body, (cache, jnp.zeros(positions.shape, jnp.float32)))[1]

  return jax.jit(run)


def target_only(config, block_fn_for, steps: int, block_width: int = 1):
  """jit: target-only greedy decoding as `generate` builds it (EOS disabled).

  Each step scores the current token in a block of `block_width` (see
  `decoding.block_to_state_fn`): 1 is the cheapest; `generate`'s default
  width makes every call the shape of a verification call.
  """

  def run(params, encoder_tokens):
    cache = T5(config).apply({"params": params}, encoder_tokens, steps, method=T5.init_cache)
    inputs = jnp.zeros((encoder_tokens.shape[0], steps), jnp.int32)
    decodes, _ = decoding.temperature_sample(
        inputs, cache, decoding.block_to_state_fn(block_fn_for(params), block_width), -1,
        temperature=0.0, topk=0)
    return decodes[:, 0]

  return jax.jit(run)


def _median_ms(samples):
  return statistics.median(samples) * 1e3


def measure(name: str, repeats: int, steps: int, calls: int, enc_len: int, count_ops: bool):
  config = named_config(name)
  model = sj.load_model(config, seed=0)
  tokens = testing.random_encoder_tokens(1, enc_len, config.vocab_size, seed=0,
                                            min_length=enc_len)
  cache = model.init_cache(1, steps, tokens)
  jobs = {}
  for path, make in PATHS.items():
    for k in (1, 5):
      positions = jnp.full((1,), steps // 2 - k, jnp.int32)
      jobs[(path, f"step_ms_k{k}")] = (functools.partial(
          block_loop(make(config), k, calls), model.params, cache, positions), calls)
    for width in BLOCK_WIDTHS:
      jobs[(path, f"target_only_ms_per_token_w{width}")] = (functools.partial(
          target_only(config, make(config), steps, width), model.params, tokens), steps)
  reference = None
  for job, (fn, _) in jobs.items():
    out = jax.block_until_ready(fn())  # compile
    if job[1].startswith("target_only"):
      if reference is None:
        reference = out
      elif not bool(jnp.array_equal(reference, out)):
        raise AssertionError(f"{name}: greedy outputs differ between the two paths")
  samples = {job: [] for job in jobs}
  for _ in range(repeats):
    for job, (fn, per) in jobs.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      samples[job].append((time.perf_counter() - start) / per)
  result = {path: {} for path in PATHS}
  for (path, what), values in samples.items():
    result[path][what] = _median_ms(values)
    # The fastest repeat: on a shared machine the least disturbed one.
    result[path][what + "_min"] = min(values) * 1e3
  if count_ops:
    for path, make in PATHS.items():
      for k in (1, 5):
        result[path][f"ops_per_layer_k{k}"] = hlo_ops.ops_per_layer(config, k, make)
  return dict(model=name, config=config.__dict__ if hasattr(config, "__dict__") else str(config),
              greedy_outputs_identical=True, **result)


def format_table(rows) -> str:
  lines = ["Times: median (fastest) of the interleaved repeats.", "",
           "| model | path | ops/layer k=1 | ops/layer k=5 | step k=1 (ms) | step k=5 (ms) | "
           "target-only ms/token, W=1 | W=8 |", "|---|---|---|---|---|---|---|---|"]
  for row in rows:
    for path in PATHS:
      r = row[path]
      ops = lambda k: r.get(f"ops_per_layer_k{k}", {}).get("total", "-")
      cell = lambda key: f"{r[key]:.3f} ({r[key + '_min']:.3f})"
      lines.append(f"| {row['model']} | {path} | {ops(1)} | {ops(5)} | {cell('step_ms_k1')} | "
                   f"{cell('step_ms_k5')} | {cell('target_only_ms_per_token_w1')} | "
                   f"{cell('target_only_ms_per_token_w8')} |")
  return "\n".join(lines)


def machine_info():
  import datetime, os, platform
  cpu = "unknown"
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
  return dict(cpu=cpu, nproc=os.cpu_count(), backend=jax.default_backend(), jax=jax.__version__,
              python=platform.python_version(), load_average=os.getloadavg(),
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def main(argv):
  del argv
  rows = [measure(name, REPEATS.value, STEPS.value, CALLS.value, ENC_LEN.value, COUNT_OPS.value)
          for name in MODELS.value]
  for row in rows:
    row["config"] = str(row["config"])
  print(format_table(rows))
  if OUTPUT.value:
    write_json_atomic(OUTPUT.value, dict(machine=machine_info(), settings=dict(
        repeats=REPEATS.value, steps=STEPS.value, calls=CALLS.value,
        encoder_length=ENC_LEN.value, batch=1, dtype="float32"), rows=rows))
    print(f"wrote {OUTPUT.value}")


if __name__ == "__main__":
  app.run(main)
