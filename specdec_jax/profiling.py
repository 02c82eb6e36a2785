"""Timing model calls the way the decode loops make them: the inputs to the theory.

c (draft step / target step) and the cost curve C(k) (target scoring k tokens
in one call / one token) decide what speculative decoding can gain on a given
machine (Theorem 3.8 assumes C(k) = 1). Every script that reports them uses
these functions, so the numbers mean the same thing everywhere.
"""

import functools
import statistics
import time
from typing import Dict, Sequence

import jax
import jax.numpy as jnp

from specdec_jax.model import Model


@functools.lru_cache(maxsize=None)
def _repeated_block_calls(config, k: int, calls: int):
  """jit: `calls` decode_block calls of k tokens in a fori_loop carrying the cache.

  The loop carries the cache as the decoders do, so keys/values are written in
  place, and sums one logit per call so no call is dead code.
  """

  def run(params, cache, positions):
    block_fn = Model(config, params).block_fn(params)
    tokens = jnp.full((positions.shape[0], k), 2, jnp.int32)

    def body(_, carry):
      cache, total = carry
      logits, cache = block_fn(tokens, positions, cache)
      return cache, total + logits[:, -1, 0]

    _, total = jax.lax.fori_loop(0, calls, body,
                                 (cache, jnp.zeros((positions.shape[0],), jnp.float32)))
    return total

  return jax.jit(run)


def time_block_calls(models: Dict[str, Model], encoder_tokens, max_len: int, ks: Sequence[int],
                     repeats: int, calls: int = 8) -> Dict[str, Dict[int, float]]:
  """Median ms of one `decode_block` call of k tokens, for each model and k.

  Args:
    models: name -> Model; all timed on the same encoder_tokens [batch, len].
    max_len: cache length; blocks are scored half way into it.
    ks: block sizes.
    repeats: timed samples per (model, k), interleaved so drift hits all alike.
    calls: calls per sample, in one compiled loop (amortises dispatch).
  Returns:
    {model name: {k: ms}}.
  """
  batch = encoder_tokens.shape[0]
  caches = {name: m.init_cache(batch, max_len, encoder_tokens) for name, m in models.items()}
  positions = {k: jnp.full((batch,), max(0, max_len // 2 - k), jnp.int32) for k in ks}
  jobs = [(name, k) for name in models for k in ks]
  run = {(name, k): functools.partial(_repeated_block_calls(models[name].config, k, calls),
                                      models[name].params, caches[name], positions[k])
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


def time_generate_pairs(target: Model, inputs, repeats: int, base_kwargs, spec_kwargs):
  """Times target-only and speculative `generate` on each input row at batch 1, paired.

  Per input: one untimed call of each (compiles on the first input), then
  `repeats` rounds of both calls, the order flipping every round, so a change in
  the load of a shared machine hits both sides alike.

  Args:
    target: the target Model; inputs: [n, len] int32 encoder tokens.
    base_kwargs / spec_kwargs: `generate` keyword arguments of each side
      (spec_kwargs carries `draft` and `gamma`).
  Returns:
    (base_seconds [n], spec_seconds [n]: per-input medians, base_outputs,
    spec_outputs: the `GenerateOutput` of each input's last call).
  """
  from specdec_jax.generation import generate

  def timed(x, kwargs):
    start = time.perf_counter()
    out = generate(target, x, **kwargs)
    jax.block_until_ready(out.sequences)
    return time.perf_counter() - start, out

  base_seconds, spec_seconds, base_outs, spec_outs = [], [], [], []
  for i in range(len(inputs)):
    x = inputs[i:i + 1]
    _, base = timed(x, base_kwargs)
    _, spec = timed(x, spec_kwargs)
    times = {"base": [], "spec": []}
    for repeat in range(repeats):
      sides = [("base", base_kwargs), ("spec", spec_kwargs)]
      for side, kwargs in (sides if repeat % 2 == 0 else sides[::-1]):
        seconds, out = timed(x, kwargs)
        times[side].append(seconds)
        if side == "base":
          base = out
        else:
          spec = out
    base_seconds.append(statistics.median(times["base"]) if repeats else float("nan"))
    spec_seconds.append(statistics.median(times["spec"]) if repeats else float("nan"))
    base_outs.append(base)
    spec_outs.append(spec)
  return base_seconds, spec_seconds, base_outs, spec_outs
