"""The tree decode loop: a draft proposes a token tree, the target scores it in one block.

Each iteration, per row:
1. the tree proposer returns a `core.token_tree.Tree` of W slots (slot 0 = the row's
   last emitted token) in depth-first order, first path first;
2. the target scores all W slots in one block call with the tree's attention
   (`core.token_tree.whole_tree_attention`), at positions root + depth;
3. `verification.tree.batched_verify_tree` keeps one root-to-node path and
   draws one more token (correction or bonus);
4. the row emits the path's tokens and that token, and the accepted path's
   keys and values are moved into place in the target's cache
   (`move_cache`) and the draft's (`TreeProposer.accept`).

Greedy identity. The first path sits where a chain puts it, so its logits
are the chain program's at width W, bit for bit; the keys of other branches
sit at other cache indices, where a reduction over the cache rounds
differently. So greedy decoding emits only tokens decided by first-path
logits: the accepted path up to the last node whose slot equals its depth
(the *frontier*), then the argmax there, which is the target-only program's
next token. The rest of the accepted path, and its bonus, become *pending*:
the first path of the next iteration's tree, where they are verified again by
first-path logits (and, barring a flipped near-tie, accepted). A branch is
thus emitted one iteration later, never differently: greedy outputs equal
target-only decoding at width W by construction. Sampling needs no frontier:
there every accepted token is emitted at once, the law being exact whatever
the rounding.
"""

import contextlib
import functools
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from specdec_jax.core import decoding
from specdec_jax.core import sampling
from specdec_jax.core.counters import LoopCounters
from specdec_jax.core.token_tree import TreeAttention, whole_tree_attention
from specdec_jax.core.verification import token as token_verification
from specdec_jax.core.verification import tree as tree_verification

Array = jax.Array
TreeBlockFn = Callable[[Array, Array, Any, Optional[TreeAttention]], Tuple[Array, Any]]
MoveFn = Callable[[Any, Array, Array], Any]


class TreeProposer(NamedTuple):
  """What a tree draft gives the loop (see `drafts.tree_draft.TreeDraft`).

  init(state, batch) -> state: the state the loop carries, from the draft's
    initial state (once, before the loop).
  propose(rng, state, sequences [batch, len + 1], lengths [batch], pending
    [batch, max_depth] int32, num_pending [batch] int32) -> (Tree with `width`
    slots, state): the tree's first path must begin with the pending tokens.
  accept(state, lengths [batch], path [batch, max_depth + 1] int32 slots,
    kept [batch] int32) -> state: path[0..kept-1] (root first) are now the
    row's tokens at positions lengths + 0..kept-1; move their keys/values
    into place.
  law: how siblings were drawn ('iid', 'without_replacement', 'topk').
  max_depth: the deepest node any tree can have (pending included).
  max_children: the most children a node can have.
  width: W, the tree's slots (the target's block width).
  reads_cache: whether `propose` also takes the target's cache (`target_cache=`).
  observe: None, or for a feature draft (`drafts.FeatureDraft` inside a
    tree): then the target's callback also returns features, and after each
    verification the state becomes observe(state, features [batch, max_depth
    + 1, f], tokens [batch, max_depth + 1], count [batch]): with n drafts on
    the accepted path, count = n + 1, tokens = the path's n tokens and the
    new (correction or bonus) token, features = the target's at the path's
    nodes (root first; feature j produced the law of token j), zeros past
    count: what the chain loop hands over (`decoding.speculative_sample`),
    a function of accepted tokens only. Greedy hands over the whole accepted
    path, pending tokens included (they are accepted tokens; the next tree
    starts with them).
  """
  init: Callable
  propose: Callable
  accept: Callable
  law: str
  max_depth: int
  max_children: int
  width: int
  observe: Optional[Callable] = None
  reads_cache: bool = False

  def placed(self, scope: Callable, constrain: Callable) -> "TreeProposer":
    """`ChainProposer.placed` for every callback of a tree (`init` runs outside any
    model, so it is pinned, not scoped)."""
    place = functools.partial(decoding.placed_call, scope=scope, constrain=constrain)
    return self._replace(
        init=decoding.placed_call(self.init, contextlib.nullcontext, constrain),
        propose=place(self.propose, with_output=True), accept=place(self.accept),
        observe=place(self.observe))

  def run(self, inputs: Array, cache: Any, target: decoding.TargetFns, draft_state: Any,
          eos_id: int, rng: Array, sampling_settings: sampling.Sampling, block_width: int,
          verification: str) -> Tuple[Array, Dict[str, Array]]:
    """Decodes with the tree loop (`tree_sample`); trees are verified by their own rule."""
    del block_width  # the tree's width is its own
    if verification != "token":
      raise ValueError(f"verification={verification!r} verifies a chain; a token tree is "
                       "verified by recursive rejection sampling over its children's law")
    return tree_sample(inputs, cache, target.block, target.move_cache, self, draft_state,
                       eos_id, decode_rng=rng, temperature=sampling_settings.temperature,
                       topk=sampling_settings.topk, topp=sampling_settings.topp)

  def parts(self, inputs: Array, cache: Any, target: decoding.TargetFns, draft_state: Any,
            eos_id: int, rng: Array, sampling_settings: sampling.Sampling, block_width: int,
            verification: str) -> decoding.LoopParts:
    """The tree loop as `decoding.LoopParts` (`tree_parts`), for loops run in segments."""
    del block_width
    if verification != "token":
      raise ValueError(f"verification={verification!r} verifies a chain; a token tree is "
                       "verified by recursive rejection sampling over its children's law")
    return tree_parts(inputs, cache, target.block, target.move_cache, self, draft_state,
                      eos_id, rng, sampling_settings)


class TreeCarry(NamedTuple):
  sequences: Array    # [batch, len + 1] BOS/last prompt token then emitted tokens
  lengths: Array      # [batch] tokens emitted so far
  done: Array         # [batch] bool
  pending: Array      # [batch, max_depth] greedy: accepted tokens past the frontier
  num_pending: Array  # [batch]
  cache: Any          # target cache
  draft_state: Any
  rng: Array
  counters: LoopCounters


def frontier(path: Array, num_accepted: Array, greedy: bool) -> Array:
  """How many accepted drafts to emit now: [batch] int32 in [0, num_accepted].

  Greedy: the accepted path's longest prefix on the first path (path[j] == j),
  whose logits are the chain program's; sampling: all of them.
  """
  if not greedy:
    return num_accepted
  depth = jnp.arange(path.shape[1])
  on_first_path = (path == depth) & (depth <= num_accepted[:, None])
  return jnp.sum(jnp.cumprod(on_first_path.astype(jnp.int32), axis=1), axis=1) - 1


def _count_tree(counters: LoopCounters, active: Array, tree, target_probs: Array, path: Array,
                num_accepted: Array, emitted: Array, verdict) -> LoopCounters:
  """One tree iteration added to the counters.

  tree: the proposal (`core.token_tree.Tree`, W slots); target_probs [batch, W,
  vocab]; path [batch, depth + 1] slots of the accepted path (-1 past it);
  num_accepted / emitted: [batch]; verdict: the tree rule's (rank counts).
  """
  batch = path.shape[0]
  depth_cap = path.shape[1] - 1
  row_ids = jnp.arange(batch)
  offsets = jnp.arange(depth_cap + 1)
  drafted_nodes = jnp.sum(tree.valid, axis=1) - 1
  depth_drafted = jnp.zeros((batch, depth_cap + 1), jnp.int32).at[
      row_ids[:, None], tree.depths].max(tree.valid.astype(jnp.int32))[:, 1:]
  reached = (offsets[None, 1:] <= num_accepted[:, None]).astype(jnp.int32)
  # beta at the nodes whose prefix was all accepted drafts (genuine samples).
  draft_law = jnp.take_along_axis(tree.probs, jnp.maximum(path, 0)[:, :, None], axis=1)
  target_law = jnp.take_along_axis(target_probs, jnp.maximum(path, 0)[:, :, None], axis=1)
  beta = token_verification.acceptance_probability(target_law, draft_law)
  has_children = jnp.take_along_axis(
      jnp.zeros((batch, tree.tokens.shape[1]), jnp.bool_).at[
          row_ids[:, None], jnp.maximum(tree.parents, 0)].max(
              tree.valid & (tree.parents >= 0)), jnp.maximum(path, 0), axis=1)
  # Pending nodes carry no draft law (greedy only): nothing to compare there.
  scored_nodes = ((path >= 0) & has_children & (jnp.sum(draft_law, axis=-1) > 0) &
                  active[:, None])
  return counters.add(
      active, drafted=drafted_nodes, emitted=emitted, accepted_raw=num_accepted,
      position_accepted=reached * active[:, None],
      position_drafted=depth_drafted * active[:, None], beta=beta, scored=scored_nodes,
      depth_histogram=jax.nn.one_hot(num_accepted, depth_cap + 1, dtype=jnp.int32),
      rank_tried=verdict.rank_tried, rank_accepted=verdict.rank_accepted)


def tree_sample(inputs: Array, cache: Any, tokens_to_logits: TreeBlockFn, move_cache: MoveFn,
                proposer: TreeProposer, draft_state: Any, eos_id: int,
                decode_rng: Optional[Array] = None, temperature: float = 1.0, topk: int = 0,
                topp: float = 0.0, max_decode_steps: Optional[int] = None
                ) -> Tuple[Array, Dict[str, Array]]:
  """Tree speculative decoding; the output is distributed exactly as `temperature_sample`'s.

  Args:
    inputs: [batch, length] int32; inputs[:, 0] is each row's first decoder
      input; decodes have this length.
    cache: the target's cache, at least length + width positions.
    tokens_to_logits: the target's block callback, called with a
      `TreeAttention` (`(tokens [batch, W], positions, cache, tree) ->
      (logits [batch, W, vocab], cache)`; with `proposer.observe`, (logits,
      features [batch, W, f], cache)).
    move_cache: `(cache, positions [batch], sources [batch, m]) -> cache`, the
      target family's `move_cache`.
    proposer / draft_state: the tree draft (`TreeProposer`) and its state.
    eos_id, decode_rng, temperature / topk / topp, max_decode_steps: as in
      `decoding.speculative_sample`.
  Returns:
    decodes [batch, length] int32 (0 after EOS) and the counters
    (`counters.LoopCounters.as_dict`, tree counters included).
  """
  settings = sampling.Sampling(temperature, topk, topp)
  return decoding.run_parts(tree_parts(
      inputs, cache, tokens_to_logits, move_cache, proposer, draft_state, eos_id,
      jax.random.PRNGKey(0) if decode_rng is None else decode_rng, settings, max_decode_steps))


def tree_parts(inputs: Array, cache: Any, tokens_to_logits: TreeBlockFn, move_cache: MoveFn,
               proposer: TreeProposer, draft_state: Any, eos_id: int, rng: Array,
               settings: sampling.Sampling, max_decode_steps: Optional[int] = None
               ) -> decoding.LoopParts:
  """`tree_sample`'s loop as `decoding.LoopParts` (arguments as there; rng: a key, or row
  keys [batch])."""
  # The chain loop's checks and step limit, so both loops refuse the same input.
  decoding.check_loop_inputs(inputs)
  greedy = settings.greedy
  batch, length = inputs.shape
  step_limit = decoding.step_limit(length, max_decode_steps)
  depth_cap = proposer.max_depth
  offsets = jnp.arange(depth_cap + 1)

  def body(carry: TreeCarry):
    rng, propose_rng, verify_rng = sampling.split_keys(carry.rng, 3)
    lengths = carry.lengths
    extra = dict(target_cache=carry.cache) if proposer.reads_cache else {}
    tree, draft_state = proposer.propose(propose_rng, carry.draft_state, carry.sequences,
                                         lengths, carry.pending, carry.num_pending, **extra)
    attention = whole_tree_attention(tree.parents, tree.depths, tree.valid, depth_cap)
    scored = decoding.as_scored(tokens_to_logits(tree.tokens, lengths, carry.cache, attention))
    cache, features = scored.cache, scored.features
    target_probs = settings.probs(scored.logits)
    verdict = tree_verification.batched_verify_tree(
        sampling.row_keys(verify_rng, batch), tree.tokens, tree.parents, tree.ranks, tree.valid,
        tree.probs, target_probs, law=proposer.law, greedy=greedy, max_depth=depth_cap,
        max_children=proposer.max_children)
    path, num_accepted = verdict.path, verdict.num_accepted

    # The accepted drafts then the new token: [batch, depth_cap + 1].
    path_tokens = jnp.take_along_axis(tree.tokens, jnp.maximum(path, 0), axis=1)
    accepted_tokens = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((batch, 1), jnp.int32)],
                                      axis=1)
    new_tokens = jnp.where(offsets < num_accepted[:, None], accepted_tokens,
                           jnp.where(offsets == num_accepted[:, None],
                                     verdict.next_token[:, None], 0))
    emit_drafts = frontier(path, num_accepted, greedy)
    # Greedy: what lies past the frontier waits for first-path logits.
    pending_index = emit_drafts[:, None] + 1 + jnp.arange(depth_cap)[None, :]
    num_pending = num_accepted - emit_drafts
    pending = jnp.where(jnp.arange(depth_cap)[None, :] < num_pending[:, None],
                        jnp.take_along_axis(new_tokens, jnp.minimum(pending_index, depth_cap),
                                            axis=1), 0)

    active = ~carry.done
    sequences, new_lengths, done, emitted = decoding.emit(
        carry.sequences, lengths, carry.done, new_tokens, emit_drafts + 1, eos_id, step_limit)

    # The emitted path's keys/values go to positions lengths + 0..kept-1.
    kept = jnp.where(active, emitted, 1)
    if not greedy:  # Greedy keeps only first-path nodes, already in place.
      sources = jnp.where(offsets < kept[:, None], jnp.maximum(path, 0), offsets)
      cache = move_cache(cache, lengths, sources)
    draft_state = proposer.accept(draft_state, lengths, path, kept)
    if proposer.observe is not None:
      if features is not None:
        on_path = offsets[None, :] <= num_accepted[:, None]
        features = jnp.where(on_path[:, :, None], jnp.take_along_axis(
            features, jnp.maximum(path, 0)[:, :, None], axis=1), 0.0)
      draft_state = proposer.observe(draft_state, features, new_tokens, num_accepted + 1)

    counters = _count_tree(carry.counters, active, tree, target_probs, path, num_accepted,
                           emitted, verdict)
    return TreeCarry(sequences, new_lengths, done, pending, jnp.where(done, 0, num_pending),
                     cache, draft_state, rng, counters)

  sequences = jnp.zeros((batch, length + 1), jnp.int32).at[:, 0].set(inputs[:, 0])
  init = TreeCarry(sequences, jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.bool_),
                   jnp.zeros((batch, depth_cap), jnp.int32), jnp.zeros((batch,), jnp.int32),
                   cache, proposer.init(draft_state, batch), rng,
                   LoopCounters.zeros(batch, depth_cap, proposer.max_children))
  return decoding.LoopParts(init, body)
