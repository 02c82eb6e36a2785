"""T5X-style decode loops: autoregressive `temperature_sample` and `speculative_sample`.

Both are pure functions carrying their state through one `lax.while_loop`, so
a whole decode is a single compiled program with no host round-trips.

Token conventions (T5X): decoder inputs start with 0 (BOS); decodes hold the
generated tokens only, and every position after a row's EOS is 0.

Callbacks:
* `temperature_sample` takes T5X's `tokens_to_logits(DecodingState) ->
  (logits [batch, vocab], new_cache)`.
* `speculative_sample` takes *block* callbacks `(tokens [batch, k], positions
  [batch], cache) -> (logits [batch, k, vocab], new_cache)`, scoring k tokens
  of each row starting at that row's own position; `block_to_state_fn` adapts
  one to the other, so both loops run the same network code.
"""

from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from specdec_jax.core import sampling
from specdec_jax.core.counters import LoopCounters
from specdec_jax.core.verification import VERIFIERS, check_verification
from specdec_jax.core.verification import token as token_verification

Array = jax.Array
BlockFn = Callable[[Array, Array, Any], Tuple[Array, Any]]


class DecodingState(NamedTuple):
  """State passed to T5X-style `tokens_to_logits`.

  cur_index: [batch] int32, position of `cur_token` in each row.
  sequences: [batch, len + 1] int32, BOS then tokens so far.
  cur_token: [batch] int32, the decoder input at cur_index.
  cache: the model's cache pytree.
  """
  cur_index: Array
  sequences: Array
  cur_token: Array
  cache: Any


# The width of every target call in both loops unless told otherwise: it
# covers gamma = 1..7. Matmuls of different shapes round differently (bf16,
# TF32, even float32 on some backends), so a target that scored 1 token per
# call alone and gamma + 1 when verifying could flip a near-tied argmax and
# part from its own greedy output. One width in both loops makes the two
# computations the same program, row for row.
DEFAULT_BLOCK_WIDTH = 8


def narrow_by_default(dtype: Optional[str], platform: Optional[str] = None) -> bool:
  """Whether `generate`'s default widths are the narrowest ones (1, or gamma + 1).

  True for float32 on CPU, False elsewhere. On a CPU a wide block is not
  free: XLA CPU's [8, 512] x [512, 32128] logits product costs 2.5x the
  [1, 512] one (it is compute-bound there), so target-only decoding at the
  fixed width 8 ran 2.3x slower than at width 1 and lost to transformers'
  greedy `generate`. The fixed width is what makes greedy speculative and
  target-only outputs identical *by construction*; at width 1 against
  gamma + 1 no construction does (scoring the gamma + 1 tokens one by one
  would cost the speedup). In float32, XLA CPU's dot kernels sum each output
  row over the contracted dimension in an order that, measured, does not
  depend on how many rows the block has: identical tokens on every row of
  near-tie random pairs of both families (tests/test_block_width.py), which
  is evidence, not proof. In bf16/fp16 on CPU (52/64 rows identical once,
  BENCHMARKS.md) and on accelerators (where width 8 costs about what width 1
  does) the fixed width stays.

  Args:
    dtype: the target's compute dtype (None: the fixed width, the policy of
      the low-level loops, which do not know it).
    platform: the devices' platform ('cpu', 'gpu', 'tpu'); default
      `jax.default_backend()`.
  """
  if dtype is None:
    return False
  platform = jax.default_backend() if platform is None else platform
  return platform == "cpu" and jnp.dtype(dtype) == jnp.float32


def resolve_block_width(block_width: Optional[int], gamma: Optional[int] = None, *,
                        dtype: Optional[str] = None, platform: Optional[str] = None,
                        slots: Optional[int] = None, what: Optional[str] = None) -> int:
  """The target's block width W in both loops.

  `block_width` when given. Otherwise, where `narrow_by_default(dtype,
  platform)` (float32 on CPU): the slots one call must hold (1 for
  target-only decoding, gamma + 1 for a chain, a tree's nodes), the
  cheapest exact widths there; elsewhere DEFAULT_BLOCK_WIDTH for every loop,
  so greedy outputs with and without a draft are identical by construction.

  Checks that a speculative block fits: `slots` tokens (gamma + 1 with
  `gamma`), described in the error by `what`. A wider block would change the
  target's numerics, so it is an error naming the width to pass, never a
  silent widening.
  """
  if gamma is not None:
    slots = int(gamma) + 1
    what = f"gamma={gamma} needs target blocks of gamma + 1 = {slots} tokens"
  if block_width is None:
    if narrow_by_default(dtype, platform):
      return 1 if slots is None else int(slots)
    width = DEFAULT_BLOCK_WIDTH
  else:
    width = block_width
  if isinstance(width, bool) or int(width) != width or width < 1:
    raise ValueError(f"block_width must be an int >= 1, got {block_width!r}")
  width = int(width)
  if slots is not None and slots > width:
    raise ValueError(
        f"{what or f'a proposal of {slots} slots'}, wider than block_width={width}"
        f"{' (the default)' if block_width is None else ''}: pass block_width={slots} (or "
        "more) to this call, and the same block_width to the target-only decoding you compare "
        "against, so both score identical block shapes.")
  return width


def pad_block(tokens: Array, block_width: int) -> Array:
  """Pads tokens [batch, k] with 0s to [batch, block_width] (k <= block_width).

  Padding rows only write keys/values past the real tokens, which no real
  query attends to (causal mask) and which are overwritten before they are.
  """
  k = tokens.shape[1]
  if k > block_width:
    raise ValueError(f"a block of {k} tokens does not fit block_width={block_width}")
  return jnp.pad(tokens, ((0, 0), (0, block_width - k)))


def block_to_state_fn(block_fn: BlockFn, block_width: Optional[int] = None
                      ) -> Callable[[DecodingState], Tuple[Array, Any]]:
  """Adapts a block callback to T5X's one-token `tokens_to_logits(state)`.

  The current token is scored as the first row of a `block_width`-wide block
  (default DEFAULT_BLOCK_WIDTH), the shape every verification call of
  `speculative_sample` with the same width uses, so greedy outputs of the two
  loops agree bit for bit on any backend and dtype. block_width=1 is the
  cheapest on CPU, where wider blocks cost more (see README).
  """
  width = resolve_block_width(block_width)

  def tokens_to_logits(state: DecodingState):
    block = pad_block(state.cur_token[:, None], width)
    scored = as_scored(block_fn(block, state.cur_index, state.cache))
    return scored.logits[:, 0], scored.cache

  return tokens_to_logits


def _repeat_rows(tree, n: int):
  return jax.tree_util.tree_map(lambda x: jnp.repeat(x, n, axis=0), tree)


def check_loop_inputs(inputs: Array) -> None:
  """Raises ValueError unless inputs is [batch, length] of integer tokens (every loop's check)."""
  if inputs.ndim != 2:
    raise ValueError(f"inputs must be [batch, length] int, got shape {inputs.shape}")
  if not jnp.issubdtype(inputs.dtype, jnp.integer):
    raise ValueError(f"inputs must be integer tokens, got dtype {inputs.dtype}")


def step_limit(length: int, max_decode_steps: Optional[int]) -> int:
  """The most tokens a row emits: max_decode_steps (checked), at most the decode's length."""
  if max_decode_steps is None:
    return length
  if int(max_decode_steps) != max_decode_steps or max_decode_steps < 1:
    raise ValueError(f"max_decode_steps must be an int >= 1, got {max_decode_steps!r}")
  return min(int(max_decode_steps), length)


def temperature_sample(inputs: Array,
                       cache: Any,
                       tokens_to_logits: Callable[[DecodingState], Tuple[Array, Any]],
                       eos_id: int,
                       decode_rng: Optional[Array] = None,
                       num_decodes: int = 1,
                       temperature: float = 1.0,
                       topk: int = 1,
                       topp: float = 0.0,
                       cache_offset: int = 0,
                       initial_index: Optional[Array] = None,
                       max_decode_steps: Optional[int] = None,
                       max_decode_steps_hard_limit: Optional[int] = None,
                       rescale_log_probs: bool = True,
                       state_callback_fn: Optional[Callable[[DecodingState], DecodingState]] = None,
                       logit_callback_fn: Optional[Callable[[Array, DecodingState], Array]] = None
                       ) -> Tuple[Array, Array]:
  """Autoregressive sampling with T5X's signature and semantics.

  Args:
    inputs: [batch, length] int32 decoder inputs, shifted right (position 0 is
      BOS = 0). Non-zero entries after position 0 are a forced prompt.
    cache: the model cache for `batch` rows (repeated for num_decodes here).
    tokens_to_logits: `(DecodingState) -> (logits [batch, vocab], cache)`.
    eos_id: end-of-sequence id.
    decode_rng: PRNG key (unused when greedy).
    num_decodes: samples per input.
    temperature / topk / topp: see `sampling.adjust_probs` (T5X's defaults:
      temperature 1, topk 1).
    cache_offset: accepted for T5X compatibility; must be 0 (caches here are
      not offset-partitioned).
    initial_index: [batch] int32, the position of each row's last prompt token.
    max_decode_steps / max_decode_steps_hard_limit: at most this many steps.
    rescale_log_probs: log_prob under the adjusted distribution (True) or under
      the raw softmax (False).
    state_callback_fn / logit_callback_fn: T5X hooks, applied every step.
  Returns:
    decodes [batch, num_decodes, length] int32 (0 after EOS), sorted per input
    by increasing log probability, and log_prob [batch, num_decodes] float32.
  """
  check_loop_inputs(inputs)
  if cache_offset != 0:
    raise ValueError("cache_offset must be 0: specdec_jax caches are not offset-partitioned")
  if int(num_decodes) != num_decodes or num_decodes < 1:
    raise ValueError(f"num_decodes must be an int >= 1, got {num_decodes!r}")
  settings = sampling.Sampling(temperature, topk, topp)
  batch, length = inputs.shape
  limit = step_limit(length, max_decode_steps)
  if max_decode_steps_hard_limit is not None:
    limit = min(limit, step_limit(length, max_decode_steps_hard_limit))
  if decode_rng is None:
    decode_rng = jax.random.PRNGKey(0)
  if initial_index is None:
    initial_index = jnp.zeros((batch,), jnp.int32)

  inputs = jnp.repeat(inputs.astype(jnp.int32), num_decodes, axis=0)
  cache = _repeat_rows(cache, num_decodes)
  initial_index = jnp.repeat(jnp.asarray(initial_index, jnp.int32), num_decodes, axis=0)
  rows = batch * num_decodes
  # One extra slot so the token predicted at the last position has a home.
  sequences = jnp.pad(inputs, ((0, 0), (0, 1)))
  row_ids = jnp.arange(rows)

  def cond(carry):
    step, _, _, ended, _, _, _ = carry
    return (step < limit) & ~jnp.all(ended)

  def body(carry):
    step, index, seqs, ended, log_prob, cache, rng = carry
    rng, step_rng = sampling.split_keys(rng, 2)
    state = DecodingState(index, seqs, seqs[row_ids, index], cache)
    if state_callback_fn is not None:
      state = state_callback_fn(state)
      seqs = state.sequences
    logits, cache = tokens_to_logits(state)
    if logit_callback_fn is not None:
      logits = logit_callback_fn(logits, state)
    probs = settings.probs(logits)
    token = settings.draw(step_rng, probs)
    next_index = index + 1
    prompt_token = seqs[row_ids, next_index]
    out_of_prompt = prompt_token == 0
    token = jnp.where(out_of_prompt, token, prompt_token)
    token = jnp.where(ended, 0, token)
    scores = jnp.log(probs) if rescale_log_probs else jax.nn.log_softmax(logits.astype(jnp.float32))
    token_log_prob = jnp.take_along_axis(scores, token[:, None], axis=-1)[:, 0]
    log_prob = log_prob + jnp.where(out_of_prompt & ~ended, token_log_prob, 0.0)
    # Rows that already ended write nowhere (aimed past the buffer, dropped).
    seqs = seqs.at[row_ids, jnp.where(ended, length + 1, next_index)].set(token, mode="drop")
    # The buffer's last slot is position `length`: a row that filled it is done.
    ended = ended | (out_of_prompt & (token == eos_id)) | (next_index >= length)
    index = jnp.where(ended, index, next_index)
    return step + 1, index, seqs, ended, log_prob, cache, rng

  init = (jnp.int32(0), initial_index, sequences, jnp.zeros((rows,), jnp.bool_),
          jnp.zeros((rows,), jnp.float32), cache, decode_rng)
  _, _, sequences, _, log_prob, _, _ = jax.lax.while_loop(cond, body, init)
  decodes = sequences[:, 1:].reshape(batch, num_decodes, length)
  log_prob = log_prob.reshape(batch, num_decodes)
  order = jnp.argsort(log_prob, axis=-1)
  return (jnp.take_along_axis(decodes, order[:, :, None], axis=1),
          jnp.take_along_axis(log_prob, order, axis=-1))


# ---------------------------------------------------------------------------
# Speculative decoding.

ProposeFn = Callable[[Array, Any, Array, Array], Tuple[Array, Array, Array, Any]]
# (draft state, features [batch, gamma + 1, f], tokens [batch, gamma + 1], count [batch])
# -> draft state; see `speculative_sample`.
ObserveFn = Callable[[Any, Array, Array, Array], Any]


def model_propose_fn(draft_tokens_to_logits: BlockFn, gamma: int, temperature: float,
                     topk: int, topp: float,
                     confidence_threshold: Optional[float] = None,
                     unroll: Optional[bool] = None) -> ProposeFn:
  """Builds a proposer that drafts up to gamma tokens with a model's block callback.

  The draft's cache has seen every position before the row's last token
  except, after a fully accepted iteration, possibly its last draft x_k (the
  draft need not feed its own last proposal). So the first call feeds the
  *two* last tokens: the overwrite of the older one is harmless (same token,
  same position, same keys), and it closes that gap without a branch. A row
  that drafts k <= gamma tokens has fed at least x_1..x_{k-1}, so this holds
  for every draft length.

  Adaptive length: a row stops drafting once it has `max_drafted` tokens, or
  (with `confidence_threshold`) when the draft's top probability for the next
  position, under its own softmax, falls below the threshold; x_1 is always
  drafted, and the loop ends when every row has stopped. The stopping rule
  reads only the draft's logits at a position *before* its token is drawn,
  never the drawn token nor the target, so exactness is kept.

  Fixed-length drafting (no threshold, no per-row limit) is unrolled when
  `unroll` is True (default: on every backend but CPU, where a loop's
  condition costs nothing and unrolling only lengthens compiles).

  The proposer maps (rng, cache, sequences [batch, len + 1], lengths [batch],
  max_drafted [batch] int32 in [1, gamma] or None) to (draft_tokens [batch,
  gamma] (0 past num_drafted), draft_probs [batch, gamma, vocab] (0 past
  num_drafted), num_drafted [batch] int32, cache).
  """

  unroll_fixed = jax.default_backend() != "cpu" if unroll is None else bool(unroll)
  settings = sampling.Sampling(temperature, topk, topp)

  def draw(logits, step_rng):
    probs = settings.probs(logits)
    return settings.draw(step_rng, probs), probs

  def confident(logits):
    if confidence_threshold is None:
      return jnp.ones(logits.shape[:-1], jnp.bool_)
    return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1) >= (
        confidence_threshold)

  def propose(rng, cache, sequences, lengths, max_drafted=None):
    batch = sequences.shape[0]
    row_ids = jnp.arange(batch)
    limit = (jnp.full((batch,), gamma, jnp.int32) if max_drafted is None else
             jnp.clip(max_drafted, 1, gamma).astype(jnp.int32))
    start = jnp.maximum(lengths - 1, 0)
    block = jnp.stack([sequences[row_ids, start], sequences[row_ids, start + 1]], axis=1)
    logits, cache = draft_tokens_to_logits(block, start, cache)
    # At length 0 the block is [BOS, padding]: read the BOS logits.
    logits = logits[row_ids, lengths - start]
    rngs = sampling.split_keys(rng, gamma)
    token, probs = draw(logits, rngs[0])
    draft_tokens = jnp.zeros((batch, gamma), jnp.int32).at[:, 0].set(token)
    draft_probs = jnp.zeros((batch, gamma) + probs.shape[-1:], jnp.float32).at[:, 0].set(probs)

    def cond(carry):
      i, _, _, _, _, _, drafting = carry
      return (i < gamma) & jnp.any(drafting)

    def body(carry):
      # Feeds x_i at position lengths + i and drafts x_{i + 1} into column i.
      i, token, cache, draft_tokens, draft_probs, num_drafted, drafting = carry
      logits, cache = draft_tokens_to_logits(token[:, None], lengths + i, cache)
      token, probs = draw(logits[:, 0], rngs[i])
      drafting = drafting & confident(logits[:, 0])
      draft_tokens = draft_tokens.at[:, i].set(jnp.where(drafting, token, 0))
      draft_probs = draft_probs.at[:, i].set(jnp.where(drafting[:, None], probs, 0.0))
      num_drafted = num_drafted + drafting
      return (i + 1, token, cache, draft_tokens, draft_probs, num_drafted,
              drafting & (num_drafted < limit))

    init = (jnp.int32(1), token, cache, draft_tokens, draft_probs,
            jnp.ones((batch,), jnp.int32), limit > 1)
    if unroll_fixed and max_drafted is None and confidence_threshold is None:
      # Fixed length: every row drafts gamma tokens, so the loop is unrolled.
      # A while loop's condition is read back by the host every step on GPUs,
      # a fixed cost per draft token that a draft step cannot afford.
      carry = init
      for _ in range(gamma - 1):
        carry = body(carry)
    else:
      carry = jax.lax.while_loop(cond, body, init)
    _, _, cache, draft_tokens, draft_probs, num_drafted, _ = carry
    return draft_tokens, draft_probs, num_drafted, cache

  return propose


class Scored(NamedTuple):
  """One target block call's results.

  logits: [batch, W, vocab]; cache: the target's new cache; features:
  [batch, W, f], the target's hidden features at the block's slots when the
  draft reads them (`drafts.base.Reads`), else None.
  """
  logits: Array
  cache: Any
  features: Optional[Array] = None


def as_scored(result) -> Scored:
  """A block callback's result as `Scored`: T5X-style callbacks return (logits, cache)."""
  return result if isinstance(result, Scored) else Scored(*result)


class TargetFns(NamedTuple):
  """The target's callbacks for the speculative loops.

  block(tokens [batch, W], positions [batch], cache, tree=None) -> Scored or
    (logits, cache): scores W tokens of each row from its own position (with
    a `core.token_tree.TreeAttention` for a token tree).
  move_cache(cache, positions [batch], sources [batch, m]) -> cache: the
    family's `move_cache` (trees only; None for chains).
  """
  block: Callable
  move_cache: Optional[Callable] = None


def placed_call(fn: Optional[Callable], scope: Callable, constrain: Callable,
                with_output: bool = False) -> Optional[Callable]:
  """`fn` traced under `scope()`, the state it returns pinned by `constrain` (None: None).

  with_output: fn returns (*outputs, state) rather than the state alone.
  """
  if fn is None:
    return None

  def call(*args, **kwargs):
    with scope():
      result = fn(*args, **kwargs)
    if with_output:
      return (*result[:-1], constrain(result[-1]))
    return constrain(result)

  return call


class ChainProposer(NamedTuple):
  """What a chain draft gives the chain loop (`drafts.base.Draft.proposer`).

  propose(rng, state, sequences [batch, len + 1], lengths [batch],
    max_drafted=None[, target_cache=]) -> (draft_tokens [batch, gamma] int32,
    draft_probs [batch, gamma, vocab] float32, num_drafted [batch] int32,
    state): up to gamma tokens per row and the laws q they were drawn from
    (the same `sampling.Sampling` as the target's). `max_drafted` ([batch]
    int32 in [1, gamma], or None) caps a row's drafts (`AdaptiveGammaDraft`);
    num_drafted may be smaller (0: no proposal, a plain target step). For
    exactness num_drafted depends on the draft's own state and outputs,
    never on the target's laws at this iteration; rows of draft_probs past
    num_drafted are ignored. With `reads_cache`, the target's cache comes as
    `target_cache=` (read only: the loop keeps its own).
  gamma: the most tokens one proposal drafts (static).
  observe: None, or (state, features, tokens, count) -> state, called after
    every verification: count [batch] = n + 1 with n drafts kept, tokens
    [batch, gamma + 1] = the n kept drafts then the new (correction or
    bonus) token, zeros past count; features [batch, gamma + 1, f] = the
    target's features at block positions 0..n (feature j produced token
    j's law), zeros past count, or None for a draft that does not read them.
    Nothing the target computed at a rejected draft reaches the draft, so
    the next proposal is a function of accepted tokens only (exactness).
  reads_cache: whether `propose` takes the target's cache.
  """
  propose: Callable
  gamma: int
  observe: Optional[Callable] = None
  reads_cache: bool = False

  def placed(self, scope: Callable, constrain: Callable) -> "ChainProposer":
    """The same proposer traced under `scope()` (e.g. the draft's activation axes on a
    mesh) with its state pinned by `constrain` after every call."""
    return self._replace(propose=placed_call(self.propose, scope, constrain, with_output=True),
                         observe=placed_call(self.observe, scope, constrain))

  def run(self, inputs: Array, cache: Any, target: TargetFns, draft_state: Any, eos_id: int,
          rng: Array, sampling_settings: sampling.Sampling, block_width: int,
          verification: str) -> Tuple[Array, Dict[str, Array]]:
    """Decodes with the chain loop (`speculative_sample`)."""
    return speculative_sample(
        inputs, cache, target.block, draft_state, None, eos_id, decode_rng=rng,
        gamma=self.gamma, temperature=sampling_settings.temperature,
        topk=sampling_settings.topk, topp=sampling_settings.topp, block_width=block_width,
        verification=verification, proposer=self)

  def parts(self, inputs: Array, cache: Any, target: TargetFns, draft_state: Any, eos_id: int,
            rng: Array, sampling_settings: sampling.Sampling, block_width: int,
            verification: str) -> "LoopParts":
    """The chain loop as `LoopParts` (`chain_parts`), for loops run in segments."""
    return chain_parts(inputs, cache, target.block, draft_state, eos_id, rng, self,
                       sampling_settings, block_width, verification)


class SpeculativeCarry(NamedTuple):
  sequences: Array       # [batch, len + 1] BOS then emitted tokens
  lengths: Array         # [batch] tokens emitted so far
  done: Array            # [batch] bool
  cache: Any             # target cache
  draft_state: Any       # draft cache or other proposer state
  rng: Array
  counters: LoopCounters


def emit(sequences: Array, lengths: Array, done: Array, new_tokens: Array, num_new: Array,
         eos_id: int, step_limit: int) -> Tuple[Array, Array, Array, Array]:
  """Appends each row's first num_new tokens, cut after an EOS and at the step limit.

  Args:
    sequences: [batch, len + 1] the tokens so far (position 0 the first input).
    lengths: [batch] tokens emitted so far; done: [batch] bool (rows that
      ended emit nothing).
    new_tokens: [batch, k] this iteration's tokens; num_new: [batch] in [1, k].
  Returns:
    (sequences, new lengths [batch], done [batch], emitted [batch] int32).
  """
  batch, k = new_tokens.shape
  offsets = jnp.arange(k)
  is_eos = (new_tokens == eos_id) & (offsets < num_new[:, None])
  eos_cut = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, k)
  emitted = jnp.minimum(jnp.minimum(num_new, eos_cut), step_limit - lengths)
  emitted = jnp.where(done, 0, emitted)
  write = offsets < emitted[:, None]
  # Unwritten slots are aimed past the buffer and dropped.
  index = jnp.where(write, lengths[:, None] + 1 + offsets, sequences.shape[1])
  sequences = sequences.at[jnp.arange(batch)[:, None], index].set(new_tokens, mode="drop")
  new_lengths = lengths + emitted
  done = done | jnp.any(is_eos & write, axis=1) | (new_lengths >= step_limit)
  return sequences, new_lengths, done, emitted


def _count_chain(counters: LoopCounters, active: Array, target_probs: Array, draft_probs: Array,
                 num_drafted: Array, num_accepted: Array, emitted: Array) -> LoopCounters:
  """One chain iteration added to the counters (probs [batch, gamma, vocab]; the rest [batch]).

  beta is averaged over positions whose prefix was all accepted drafts, i.e.
  genuine samples: positions 0..min(n, num_drafted - 1).
  """
  offsets = jnp.arange(draft_probs.shape[1])
  beta = token_verification.acceptance_probability(target_probs, draft_probs)
  scored = ((offsets <= num_accepted[:, None]) & (offsets < num_drafted[:, None]) &
            active[:, None])
  drafted_mask = (offsets < num_drafted[:, None]) & active[:, None]
  return counters.add(
      active, drafted=num_drafted, emitted=emitted, accepted_raw=num_accepted,
      position_accepted=drafted_mask & (offsets < num_accepted[:, None]),
      position_drafted=drafted_mask, beta=beta, scored=scored)


def _as_proposer(proposer: Optional[ChainProposer], propose_fn, observe_fn,
                 draft_tokens_to_logits, gamma: int, settings: sampling.Sampling
                 ) -> ChainProposer:
  """`speculative_sample`'s proposer: the one given (of this gamma), or one built from
  loose callbacks (a proposer's, or a draft model's block callback)."""
  if proposer is not None:
    if proposer.gamma != gamma:
      raise ValueError(f"the proposer drafts gamma={proposer.gamma} tokens, the loop was given "
                       f"gamma={gamma}")
    return proposer
  if propose_fn is None:
    if draft_tokens_to_logits is None:
      raise ValueError("speculative_sample needs a proposer, propose_fn or "
                       "draft_tokens_to_logits")
    propose_fn = model_propose_fn(draft_tokens_to_logits, gamma, settings.temperature,
                                  settings.topk, settings.topp)
  return ChainProposer(propose_fn, gamma, observe_fn)


def speculative_sample(inputs: Array,
                       cache: Any,
                       tokens_to_logits: BlockFn,
                       draft_cache: Any,
                       draft_tokens_to_logits: Optional[BlockFn],
                       eos_id: int,
                       decode_rng: Optional[Array] = None,
                       gamma: int = 4,
                       temperature: float = 1.0,
                       topk: int = 1,
                       topp: float = 0.0,
                       max_decode_steps: Optional[int] = None,
                       propose_fn: Optional[ProposeFn] = None,
                       block_width: Optional[int] = None,
                       verification: str = "token",
                       observe_fn: Optional[ObserveFn] = None,
                       proposer: Optional[ChainProposer] = None
                       ) -> Tuple[Array, Dict[str, Array]]:
  """Speculative decoding loop; the output is distributed exactly as `temperature_sample`'s.

  Each iteration: the draft proposes gamma tokens per row; the target scores
  the row's last token and the gamma drafts (gamma + 1 positions, padded to
  `block_width`) in one block call; the verification rule keeps n drafts and
  draws one more token; each row appends its n + 1 tokens and advances its
  *own* length. Caches roll back by position only: whatever a rejected draft
  wrote lies past the row's length and is overwritten later.

  Args:
    inputs: [batch, length] int32: inputs[:, 0] is each row's first decoder
      input (BOS = 0 for T5; a decoder-only model's last prompt token), the
      rest only gives the shape (no forced prompts here): decodes have this
      length.
    cache: target cache with at least `length` positions.
    tokens_to_logits: the target's block callback, returning (logits [batch,
      W, vocab], cache) or a `Scored` (with features for a draft that reads
      them).
    draft_cache: the draft's cache (or the state of its proposer).
    draft_tokens_to_logits: a draft model's block callback (ignored with a
      proposer).
    eos_id: end-of-sequence id.
    decode_rng: PRNG key.
    gamma: tokens drafted per iteration (>= 1).
    temperature / topk / topp: the adjustment applied to target and draft alike.
    max_decode_steps: at most this many tokens per row.
    propose_fn / observe_fn: a proposer's callbacks given loose (see
      `ChainProposer`), when `proposer` is not given.
    block_width: width W of every target call (default DEFAULT_BLOCK_WIDTH);
      >= gamma + 1. Target-only decoding through `block_to_state_fn` with the
      same W gives bit-identical greedy outputs.
    verification: the rule that keeps drafts, a name in VERIFIERS: "token"
      (Leviathan et al., the first rejection ends the block) or "block"
      (Sun et al. 2025: same output law, at least as many accepted drafts on
      average; greedy outputs identical).
    proposer: the draft's `ChainProposer` (its gamma must equal `gamma`).
  Returns:
    decodes [batch, length] int32 (0 after EOS) and the per-row counters
    (`counters.LoopCounters.as_dict`).
  """
  check_loop_inputs(inputs)
  check_verification(verification)
  if int(gamma) != gamma or gamma < 1:
    raise ValueError(f"gamma must be an int >= 1, got {gamma!r}")
  settings = sampling.Sampling(temperature, topk, topp)
  proposer = _as_proposer(proposer, propose_fn, observe_fn, draft_tokens_to_logits, int(gamma),
                          settings)
  parts = chain_parts(inputs, cache, tokens_to_logits, draft_cache, eos_id,
                      jax.random.PRNGKey(0) if decode_rng is None else decode_rng, proposer,
                      settings, block_width, verification, max_decode_steps)
  return run_parts(parts)


class LoopParts(NamedTuple):
  """A decode loop as pure parts, for loops run whole (`run_parts`) or in segments
  (`sj.generate_many`, which stops the loop when a row ends and refills the row).

  init: the carry before the first iteration (a NamedTuple with `sequences` [batch,
    len + 1], `lengths` [batch], `done` [batch] bool and `counters`; every leaf has a
    batch axis).
  body: carry -> carry, one iteration (rows that are done emit nothing).
  """
  init: Any
  body: Callable


def run_parts(parts: LoopParts) -> Tuple[Array, Dict[str, Array]]:
  """Iterates `parts` until every row is done: (decodes [batch, len], counters dict)."""
  final = jax.lax.while_loop(lambda carry: ~jnp.all(carry.done), parts.body, parts.init)
  return final.sequences[:, 1:], final.counters.as_dict()


def chain_parts(inputs: Array, cache: Any, tokens_to_logits: BlockFn, draft_state: Any,
                eos_id: int, rng: Array, proposer: ChainProposer, settings: sampling.Sampling,
                block_width: Optional[int], verification: str = "token",
                max_decode_steps: Optional[int] = None) -> LoopParts:
  """`speculative_sample`'s loop as `LoopParts` (arguments as there; rng: a key, or row
  keys [batch] so that each row draws from its own, `sampling.split_keys`)."""
  check_loop_inputs(inputs)
  gamma = proposer.gamma
  width = resolve_block_width(block_width, gamma)
  verify = VERIFIERS[check_verification(verification)]
  batch, length = inputs.shape
  limit = step_limit(length, max_decode_steps)
  row_ids = jnp.arange(batch)
  offsets = jnp.arange(gamma + 1)
  target_extra = lambda cache: dict(target_cache=cache) if proposer.reads_cache else {}  # noqa

  def body(carry: SpeculativeCarry):
    rng, propose_rng, accept_rng = sampling.split_keys(carry.rng, 3)
    lengths = carry.lengths
    draft_tokens, draft_probs, num_drafted, draft_state = proposer.propose(
        propose_rng, carry.draft_state, carry.sequences, lengths, **target_extra(carry.cache))
    last_token = carry.sequences[row_ids, lengths]
    block = pad_block(jnp.concatenate([last_token[:, None], draft_tokens], axis=1), width)
    scored = as_scored(tokens_to_logits(block, lengths, carry.cache))
    target_probs = settings.probs(scored.logits[:, :gamma + 1])
    num_accepted, next_token = verify(
        sampling.row_keys(accept_rng, batch), draft_tokens, draft_probs, target_probs,
        num_drafted, greedy=settings.greedy)

    # The n accepted drafts, then the new token, then nothing.
    padded_drafts = jnp.pad(draft_tokens, ((0, 0), (0, 1)))
    new_tokens = jnp.where(offsets < num_accepted[:, None], padded_drafts,
                           jnp.where(offsets == num_accepted[:, None], next_token[:, None], 0))
    if proposer.observe is not None:
      features = scored.features
      if features is not None:
        kept = offsets[None, :, None] <= num_accepted[:, None, None]
        features = jnp.where(kept, features[:, :gamma + 1], 0.0)
      draft_state = proposer.observe(draft_state, features, new_tokens, num_accepted + 1)
    active = ~carry.done
    sequences, new_lengths, done, emitted = emit(carry.sequences, lengths, carry.done,
                                                 new_tokens, num_accepted + 1, eos_id, limit)

    counters = _count_chain(carry.counters, active, target_probs[:, :gamma], draft_probs,
                            num_drafted, num_accepted, emitted)
    return SpeculativeCarry(sequences, new_lengths, done, scored.cache, draft_state, rng,
                            counters)

  sequences = jnp.zeros((batch, length + 1), jnp.int32).at[:, 0].set(inputs[:, 0])
  init = SpeculativeCarry(sequences, jnp.zeros((batch,), jnp.int32),
                          jnp.zeros((batch,), jnp.bool_), cache, draft_state, rng,
                          LoopCounters.zeros(batch, gamma))
  return LoopParts(init, body)


def target_parts(inputs: Array, cache: Any, tokens_to_logits: BlockFn, eos_id: int, rng: Array,
                 settings: sampling.Sampling, block_width: Optional[int],
                 max_decode_steps: Optional[int] = None) -> LoopParts:
  """Target-only decoding as `LoopParts` whose rows keep their own lengths (so a row can
  restart while others continue, `sj.generate_many`): each iteration scores each row's
  last token as the first slot of a `block_width` block at the row's own position, as
  `temperature_sample` with `block_to_state_fn` does (greedy outputs agree bit for bit),
  and draws one token. The carry is a `SpeculativeCarry` (no draft state; counters unused)."""
  check_loop_inputs(inputs)
  width = resolve_block_width(block_width)
  batch, length = inputs.shape
  limit = step_limit(length, max_decode_steps)
  row_ids = jnp.arange(batch)

  def body(carry: SpeculativeCarry):
    block = pad_block(carry.sequences[row_ids, carry.lengths][:, None], width)
    scored = as_scored(tokens_to_logits(block, carry.lengths, carry.cache))
    if settings.greedy:  # the one-hot's argmax is the logits' argmax; no key is used
      rng, token = carry.rng, sampling.argmax(scored.logits[:, 0])
    else:
      rng, step_rng = sampling.split_keys(carry.rng, 2)
      token = settings.draw(step_rng, settings.probs(scored.logits[:, 0]))
    sequences, lengths, done, _ = emit(carry.sequences, carry.lengths, carry.done,
                                       token[:, None], jnp.ones((batch,), jnp.int32), eos_id,
                                       limit)
    counters = carry.counters._replace(iterations=carry.counters.iterations + ~carry.done)
    return carry._replace(sequences=sequences, lengths=lengths, done=done, cache=scored.cache,
                          rng=rng, counters=counters)

  sequences = jnp.zeros((batch, length + 1), jnp.int32).at[:, 0].set(inputs[:, 0])
  init = SpeculativeCarry(sequences, jnp.zeros((batch,), jnp.int32),
                          jnp.zeros((batch,), jnp.bool_), cache, {}, rng,
                          LoopCounters.zeros(batch, 1))
  return LoopParts(init, body)


def decode(inputs: Array, cache: Any, target: TargetFns, eos_id: int, rng: Array, *,
           sampling_settings: sampling.Sampling, block_width: Optional[int],
           proposer: Any = None, draft_state: Any = None, verification: str = "token"
           ) -> Tuple[Array, Optional[Dict[str, Array]]]:
  """Target-only decoding, or speculative decoding when a proposer is given.

  The one place every family and every draft kind choose their loop, so
  target-only and speculative decoding always see the same target callback
  and block width.

  Args:
    inputs: [batch, length] int32; inputs[:, 0] is each row's first input.
    cache / target: the target's cache and callbacks (`TargetFns`).
    proposer / draft_state: the draft's `ChainProposer` or
      `tree_decoding.TreeProposer` (each runs its own loop) and its state.
    verification: see `speculative_sample`; "token" only without a draft.
  Returns:
    decodes [batch, length] int32 and the speculative counters (None without
    a draft).
  """
  if proposer is None:
    if check_verification(verification) != "token":
      raise ValueError(f"verification={verification!r} applies to speculative decoding; "
                       "pass a draft")
    decodes, _ = temperature_sample(
        inputs, cache, block_to_state_fn(target.block, block_width), eos_id,
        decode_rng=rng, temperature=sampling_settings.temperature,
        topk=sampling_settings.topk, topp=sampling_settings.topp)
    return decodes[:, 0], None
  return proposer.run(inputs, cache, target, draft_state, eos_id, rng, sampling_settings,
                      block_width, verification)
