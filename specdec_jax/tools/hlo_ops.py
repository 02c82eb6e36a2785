"""Counting the operations of a compiled decode step, per decoder layer.

On an accelerator a small decoder's step is launch-bound: it costs about a
fixed amount per operation the compiled program runs, whatever the width.
So the number of operations per decoder layer is the thing
to cut and to pin. An "operation" here is one instruction that XLA schedules
as its own unit of work: a fusion, a dot, a custom call, a copy, a while or
conditional, ... in the entry computation or in a while body / conditional
branch. Instructions that move no data (parameter, constant, tuple,
get-tuple-element, bitcast) are not counted, nor anything inside a fusion.

The per-layer count is the difference between the programs of the same
config with L + 1 and L decoder layers, so the fixed cost of a call
(embedding, logits, position bias, loop bookkeeping) cancels.
"""

import collections
import re
from typing import Callable, Dict, Optional

import jax
import jax.numpy as jnp

from specdec_jax.families.registry import family_of

# Instructions that move no data and launch nothing.
FREE_OPS = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                      "after-all", "partition-id", "replica-id", "opt-barrier"})

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(r"(?:calls|to_apply|scatter)=%?([\w.\-]+)")


def _computations(hlo_text: str) -> Dict[str, list]:
  """{computation name: [instruction lines]} of an HLO module's text; 'ENTRY' names the entry."""
  computations, name = {}, None
  for line in hlo_text.splitlines():
    if name is None:
      match = _COMPUTATION.match(line)
      if match and not line.startswith("HloModule"):
        name = "ENTRY" if match.group(1) else match.group(2)
        computations[name] = []
    elif line.startswith("}"):
      name = None
    else:
      computations[name].append(line)
  return computations


def count_ops(hlo_text: str) -> collections.Counter:
  """Operations by opcode in an optimised HLO module's text (see the module docstring).

  Counts the instructions of every *scheduled* computation: the entry, while
  bodies and conditions, conditional branches. Computations only reached as a
  fusion's body or a reduction's combiner (`calls=`, `to_apply=`) run inside
  their caller and are not counted.
  """
  computations = _computations(hlo_text)
  if "ENTRY" not in computations:
    raise ValueError("no ENTRY computation in the HLO text (pass compiled().as_text())")
  inner = set()
  for lines in computations.values():
    for line in lines:
      opcode = _INSTRUCTION.match(line)
      if opcode and opcode.group(1) in ("fusion", "reduce", "reduce-window", "map", "sort",
                                         "scatter", "select-and-scatter", "all-reduce",
                                         "reduce-scatter", "custom-call"):
        inner.update(_CALLED.findall(line))
  ops = collections.Counter()
  for name, lines in computations.items():
    if name in inner:
      continue
    for line in lines:
      opcode = _INSTRUCTION.match(line)
      if opcode and opcode.group(1) not in FREE_OPS:
        ops[opcode.group(1)] += 1
  return ops


def compiled_block_text(config, k: int, block_fn_for: Callable,
                        batch: int = 1, max_len: int = 64, context_len: int = 16) -> str:
  """Optimised HLO of the block call scoring k tokens, as the decode loops run it.

  The block call sits in a while loop that carries the cache, the tokens
  (the argmax of the last logits) and the positions (advancing by one), as in
  `decoding`; the trip count is an argument, so the loop is not unrolled. The
  cache is then updated in place, and the loop body is the per-step work.

  Args:
    config: a config of any registered family (shapes only: nothing is
      allocated).
    k: tokens per row in the block.
    block_fn_for: params -> block callback at absolute positions `(tokens
      [batch, k], positions [batch], cache) -> (logits [batch, k, vocab],
      cache)`, e.g. `lambda p: family.block_fn(config, p)`.
    batch / max_len / context_len: shapes of the traced call (the context:
      T5's encoder tokens, a decoder-only prompt; its cache is built by
      `family.start` as `generate` builds it).
  """
  family = family_of(config)
  params = jax.eval_shape(lambda: family.init_params(config, 0))
  tokens = jnp.ones((batch, context_len), jnp.int32)
  lengths = jnp.full((batch,), context_len, jnp.int32)
  cache = jax.eval_shape(lambda p: family.start(config, p, tokens, lengths, max_len).cache,
                         params)

  def run(params, tokens, positions, cache, calls):
    block_fn = block_fn_for(params)

    def body(carry):
      # Tokens and positions change every step, as in decoding, so that XLA
      # cannot hoist work that depends on them alone out of the loop.
      i, tokens, positions, cache = carry
      logits, cache = block_fn(tokens, positions, cache)
      tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      positions = (positions + 1) % (max_len - k + 1)
      return i + 1, tokens, positions, cache

    _, tokens, _, cache = jax.lax.while_loop(lambda c: c[0] < calls, body,
                                             (jnp.int32(0), tokens, positions, cache))
    return tokens, cache

  args = (params, jax.ShapeDtypeStruct((batch, k), jnp.int32),
          jax.ShapeDtypeStruct((batch,), jnp.int32), cache,
          jax.ShapeDtypeStruct((), jnp.int32))
  return jax.jit(run, donate_argnums=(3,)).lower(*args).compile().as_text()


# The config field that holds the decoder's depth, per layout. The family
# contract has no accessor for it, so the first of these that a config has is
# the one varied (T5: num_decoder_layers; decoder-only: num_layers).
DEPTH_FIELDS = ("num_decoder_layers", "num_layers")


def depth_field(config) -> str:
  """The name of `config`'s decoder-depth field (see DEPTH_FIELDS)."""
  for name in DEPTH_FIELDS:
    if hasattr(config, name):
      return name
  raise ValueError(f"{type(config).__name__} has none of the decoder-depth fields "
                   f"{DEPTH_FIELDS}; pass depth=")


def ops_per_layer(config, k: int, block_fn_for: Optional[Callable] = None,
                  layers: int = 2, depth: Optional[str] = None, **shapes) -> Dict[str, int]:
  """Operations one more decoder layer adds to the compiled decode step.

  Args:
    config: a config of any registered family; its decoder depth is replaced
      by `layers` and `layers + 1`.
    k: tokens per row in the block.
    block_fn_for: config -> (params -> block callback); default: the
      family's `block_fn`, what the decode loops run
      (`profiling.family_block_fn`).
    depth: the config field of the decoder depth (default `depth_field(config)`).
    shapes: batch / max_len / context_len, see `compiled_block_text`.
  Returns:
    {opcode: count difference} for opcodes whose count changed, plus 'total'.
  """
  from specdec_jax.tools.profiling import family_block_fn
  block_fn_for = family_block_fn if block_fn_for is None else block_fn_for
  depth = depth_field(config) if depth is None else depth
  counts = []
  for n in (layers, layers + 1):
    cfg = config.replace(**{depth: n})
    counts.append(count_ops(compiled_block_text(cfg, k, block_fn_for(cfg), **shapes)))
  before, after = counts
  diff = {op: after[op] - before[op] for op in sorted(set(before) | set(after))
          if after[op] != before[op]}
  diff["total"] = sum(after.values()) - sum(before.values())
  return diff
