"""Timing model calls the way the decode loops make them: the inputs to the theory.

c (draft step / target step) and the cost curve C(k) (target scoring k tokens
in one call / one token) decide what speculative decoding can gain on a given
machine (Theorem 3.8 assumes C(k) = 1). Every script that reports them uses
these functions, so the numbers mean the same thing everywhere.
"""

import dataclasses
import functools
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.families.t5.model import Model
from specdec_jax.families.t5 import decode as t5_decode


@functools.lru_cache(maxsize=None)
def _repeated_block_calls(config, k: int, calls: int, attention: Optional[str] = None):
  """jit: `calls` decode_block calls of k tokens in a fori_loop carrying the cache.

  The loop carries the cache as the decoders do, so keys/values are written in
  place, and sums one logit per call so no call is dead code. Tokens and
  positions change every call, as in a decode loop: with fixed ones XLA would
  hoist the token-only work (embedding, position bias) out of the loop and a
  small draft's step would read too cheap. The fused kernels are prepared
  once, outside the timed loop (`prepare`), as a decode loop prepares them
  once per decode.
  """

  def run(prepared, cache, positions):
    block_fn = lambda tokens, positions, cache: t5_decode.decode_block(
        prepared, config, tokens, positions, cache, attention)

    def body(i, carry):
      cache, total = carry
      tokens = jnp.full((positions.shape[0], k), 2, jnp.int32) + i % 3
      logits, cache = block_fn(tokens, positions + i % 2, cache)
      return cache, total + logits[:, -1, 0]

    _, total = jax.lax.fori_loop(0, calls, body,
                                 (cache, jnp.zeros((positions.shape[0],), jnp.float32)))
    return total

  return jax.jit(run)


def time_block_calls(models: Dict[str, Model], encoder_tokens, max_len: int, ks: Sequence[int],
                     repeats: int, calls: int = 8,
                     attention: Optional[str] = None) -> Dict[str, Dict[int, float]]:
  """Median ms of one `decode_block` call of k tokens, for each model and k.

  Args:
    models: name -> Model; all timed on the same encoder_tokens [batch, len].
    max_len: cache length; blocks are scored half way into it.
    ks: block sizes.
    repeats: timed samples per (model, k), interleaved so drift hits all alike.
    calls: calls per sample, in one compiled loop (amortises dispatch).
    attention: `t5_decode.decode_block`'s formulation (default: the
      backend's, what the decode loops run).
  Returns:
    {model name: {k: ms}}.
  """
  batch = encoder_tokens.shape[0]
  caches = {name: m.init_cache(batch, max_len, encoder_tokens) for name, m in models.items()}
  # One below the middle, so the loop's alternating +1 stays inside the cache.
  positions = {k: jnp.full((batch,), max(0, max_len // 2 - k - 1), jnp.int32) for k in ks}
  jobs = [(name, k) for name in models for k in ks]
  prepared = {name: jax.jit(t5_decode.prepare_decode_params, static_argnums=1)(
      m.params, m.config) for name, m in models.items()}
  run = {(name, k): functools.partial(_repeated_block_calls(models[name].config, k, calls,
                                                            attention),
                                      prepared[name], caches[name], positions[k])
         for name, k in jobs}
  for job in jobs:
    jax.block_until_ready(run[job]())  # Compile.
  samples = {job: [] for job in jobs}
  for _ in range(repeats):
    for job in jobs:
      start = time.perf_counter()
      jax.block_until_ready(run[job]())
      samples[job].append((time.perf_counter() - start) / calls * 1e3)
  out = {name: {} for name in models}
  for (name, k), ms in samples.items():
    out[name][k] = statistics.median(ms)
  return out


def block_step_seconds(model: Model, encoder_tokens, k: int, max_decode_len: int,
                       repeats: int) -> float:
  """Median seconds of one `decode_block` call scoring k tokens per row."""
  ms = time_block_calls({"model": model}, encoder_tokens, max_decode_len, [k], repeats)
  return ms["model"][k] / 1e3


@dataclasses.dataclass
class PairedTimes:
  """Per-input timings of target-only vs speculative `generate` (see time_generate_pairs).

  base_seconds: [n] the fastest exact target-only decoding (block width
    `base_width`) per input; spec_seconds: [n] speculative decoding.
  base_width: the target-only block width that was fastest over all inputs
    (1 or the speculative loop's width W): speedups are against it.
  reference_width: W, the width of the target-only decoding that speculative
    outputs are checked against (identical greedy outputs by construction).
  width_seconds: {width: [n]} per-input medians of each target-only width.
  reference_outputs / spec_outputs: [n] `GenerateOutput`s of the last call.
  """
  base_seconds: List[float]
  spec_seconds: List[float]
  base_width: int
  reference_width: int
  width_seconds: Dict[int, List[float]]
  reference_outputs: List[Any]
  spec_outputs: List[Any]

  @property
  def identical(self) -> bool:
    """Greedy: every speculative output equals target-only decoding at width W."""
    return all(np.array_equal(np.asarray(r.sequences), np.asarray(s.sequences))
               for r, s in zip(self.reference_outputs, self.spec_outputs))


def time_generate_pairs(target: Model, inputs, repeats: int, base_kwargs,
                        spec_kwargs) -> PairedTimes:
  """Times target-only and speculative `generate` on each input row at batch 1, paired.

  The baseline is the *fastest exact* target-only decoding: the target at the
  speculative loop's block width W (whose greedy output speculative decoding
  reproduces bit for bit) and at width 1 (often faster on CPUs, where wider
  blocks cost more) are both timed, and speedups use the faster one, so the
  fixed width never flatters a speedup.

  Per input: one untimed call of each side (compiles on the first input), then
  `repeats` rounds of all sides, the order rotating every round, so a change in
  the load of a shared machine hits every side alike.

  Args:
    target: the target Model; inputs: [n, len] int32 encoder tokens.
    base_kwargs / spec_kwargs: `generate` keyword arguments of each side
      (spec_kwargs carries `draft` and `gamma`). A `block_width` in
      base_kwargs pins the baseline to that width alone.
  Returns:
    PairedTimes.
  """
  from specdec_jax.core.decoding import resolve_block_width
  from specdec_jax.generation import generate

  gamma = spec_kwargs.get("gamma", 4) if spec_kwargs.get("draft") is not None else None
  width = resolve_block_width(spec_kwargs.get("block_width"), gamma)
  sides = {("base", width): dict(base_kwargs, block_width=width)}
  if "block_width" in base_kwargs:
    sides = {("base", base_kwargs["block_width"]): dict(base_kwargs)}
  elif width != 1:
    sides[("base", 1)] = dict(base_kwargs, block_width=1)
  sides[("spec", width)] = spec_kwargs

  def timed(x, kwargs):
    start = time.perf_counter()
    out = generate(target, x, **kwargs)
    jax.block_until_ready(out.sequences)
    return time.perf_counter() - start, out

  medians = {side: [] for side in sides}
  last = {side: [] for side in sides}
  order = list(sides)
  for i in range(len(inputs)):
    x = inputs[i:i + 1]
    outs = {side: timed(x, kwargs)[1] for side, kwargs in sides.items()}
    times = {side: [] for side in sides}
    for repeat in range(repeats):
      shift = repeat % len(order)
      for side in order[shift:] + order[:shift]:
        seconds, outs[side] = timed(x, sides[side])
        times[side].append(seconds)
    for side in sides:
      medians[side].append(statistics.median(times[side]) if repeats else float("nan"))
      last[side].append(outs[side])
  base_sides = [side for side in sides if side[0] == "base"]
  fastest = min(base_sides, key=lambda side: sum(medians[side]) if repeats else side[1])
  reference = ("base", width) if ("base", width) in sides else fastest
  return PairedTimes(
      base_seconds=medians[fastest], spec_seconds=medians[("spec", width)],
      base_width=fastest[1], reference_width=reference[1],
      width_seconds={side[1]: medians[side] for side in base_sides},
      reference_outputs=last[reference], spec_outputs=last[("spec", width)])
