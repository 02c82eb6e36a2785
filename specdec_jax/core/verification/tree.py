"""Exact token-tree verification (recursive rejection sampling) and drawing a node's children.

A tree iteration has drafted several continuations at once (`core.token_tree`):
node 0 is the row's last emitted token, every other node a drafted token, and
the target has scored every node. Verification keeps one root-to-node path
and draws one more token, so that the emitted tokens are distributed exactly
as the target's own samples (SpecInfer arXiv 2305.09781, RSD arXiv
2402.14160, Sequoia arXiv 2402.12374).

At node u with target law p_u and children x_1..x_k tried in rank order,
q^(j) being the exact law child j was drawn from given the earlier children:
the current residual starts at p^(1) = p_u; x_j is accepted with probability
min(1, p^(j)(x_j) / q^(j)(x_j)) and verification descends into it (its own
residual restarts at p_{x_j}); on rejection p^(j+1) = norm(max(p^(j) - q^(j), 0))
(`token.normalised_residual`, the chain rule's normalisation) and the next
child is tried. When every child is rejected the next token (the correction)
is drawn from the last residual; at an accepted leaf it is the bonus token,
drawn from the target there. With one child per node this is
`token.speculative_step`'s chain rule.

The sibling law (`law`, a name in TREE_LAWS) is how the children were drawn
and so decides q^(j); each is a `SiblingLaw` object:
* "iid" (`IID`): every child drawn independently from q_u, so q^(j) = q_u
  (SpecInfer). Siblings may repeat a token; a repeat is tried again against
  the residual.
* "without_replacement" (`WithoutReplacement`): child j drawn from q_u with
  the earlier siblings' tokens removed, renormalised (RSD, Sequoia).
  Siblings must be distinct.
* "topk" (`TopK`): the children are the draft's k most likely tokens, fixed
  given the draft's state, so q^(j) is a point mass at x_j: x_j is accepted
  with probability p^(j)(x_j), else x_j's mass is removed from the residual.

Exactness needs the draft laws to be the true laws of the candidates (the same
sampling adjustment as the target's), fresh randomness for every decision,
and a set of children per node that may depend on the draft's state and on
earlier siblings but not on a *drawn* child's own token (`draw_children`'s
invalid children, which can never be accepted, are the exception that costs
nothing). "topk" children are no draw: any choice among them made from the
draft's state alone, such as `drafts.tree_draft.DynamicTreeDraft`'s pruning by
cumulative draft probability, leaves a list fixed before the target is read,
which the point-mass rule verifies exactly.
"""

import functools
from typing import Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from specdec_jax.core import sampling
from specdec_jax.core.verification import token as token_verification

Array = jax.Array


class SiblingLaw:
  """How a node's children are drawn from the draft's law q_u [vocab] there.

  A law gives the children (`draw`) and, for verification, q^(j) [vocab]:
  the exact law child j was drawn from given its earlier siblings
  (`child_law`), from a per-node state (`removed` [vocab] bool, the tokens
  of the siblings tried so far where the law needs them; `after_try`), and
  the residual after a rejection (`residual`).
  Subclasses set `name` (their key in TREE_LAWS) and `distinct` (siblings
  never repeat a token, so at most vocab children), and define `_sample`
  and `child_law`.
  """
  name: str = ""
  distinct: bool = True

  def __repr__(self) -> str:
    return f"{type(self).__name__}()"

  def draw(self, key: Array, probs: Array, k: int,
           rank_scores: Optional[Array] = None) -> Tuple[Array, Array]:
    """Draws k children of one node, in rank order (`draw_children`'s contract).

    Args:
      key: PRNG key (unused by "topk" and with rank_scores).
      probs: [vocab] float32, the draft's adjusted law at the node.
      k: static int >= 1; <= vocab when `distinct` or rank_scores is given.
      rank_scores: optional [vocab] float scores (greedy decoding): the
        children are then their top k, whatever the law.
    Returns:
      (tokens [k] int32, valid [k] bool: probs[token] > 0, or
      rank_scores[token] > -inf when rank_scores is given). Invalid children
      come after the valid ones.
    """
    vocab = probs.shape[-1]
    if probs.shape != (vocab,):
      raise ValueError(f"probs must be [vocab], got {probs.shape}")
    if int(k) != k or k < 1:
      raise ValueError(f"k must be an int >= 1, got {k!r}")
    if (self.distinct or rank_scores is not None) and k > vocab:
      raise ValueError(f"k ({k}) distinct children exceed the vocabulary size ({vocab})")
    if rank_scores is not None:
      if rank_scores.shape != (vocab,):
        raise ValueError(f"rank_scores must be [vocab] = {(vocab,)}, got {rank_scores.shape}")
      scores, tokens = jax.lax.top_k(jnp.asarray(rank_scores), k)  # ties: lower index first
      return tokens.astype(jnp.int32), scores > -jnp.inf
    probs = jnp.asarray(probs, jnp.float32)
    tokens = self._sample(key, probs, k).astype(jnp.int32)
    return tokens, probs[tokens] > 0

  def _sample(self, key: Array, probs: Array, k: int) -> Array:
    """The law's k children: key a PRNG key, probs [vocab] float32. Returns [k] int."""
    raise NotImplementedError

  def child_law(self, draft_probs: Array, removed: Array, token: Array) -> Array:
    """q^(j) [vocab] float32, the law the child `token` was drawn from.

    Args:
      draft_probs: [vocab] float32, q_u at the parent.
      removed: [vocab] bool, the node's state (`after_try`).
      token: int32 scalar, the child's token.
    """
    raise NotImplementedError

  def after_try(self, removed: Array, tried: Array, token: Array) -> Array:
    """The node's state removed [vocab] bool after trying the child `token`.

    tried: bool scalar, whether the child was tried; token: int32 scalar.
    Returns [vocab] bool. The default keeps the state unchanged: the later
    siblings' laws do not depend on the earlier ones.
    """
    del tried, token
    return removed

  def residual(self, residual: Array, q: Array) -> Array:
    """p^(j+1) = norm(max(p^(j) - q^(j), 0)) [vocab] after a rejection.

    residual: [vocab] float32, p^(j); q: [vocab] float32, q^(j). No mass
    left happens only by rounding (p^(j) == q^(j), where rejection has
    probability zero): p^(j) itself is then the right law.
    """
    return token_verification.normalised_residual(jnp.maximum(residual - q, 0.0), residual)


class IID(SiblingLaw):
  """Every child drawn independently from q_u: q^(j) = q_u (SpecInfer); repeats possible."""
  name = "iid"
  distinct = False

  def _sample(self, key: Array, probs: Array, k: int) -> Array:
    """k independent draws from probs [vocab]. Returns [k] int."""
    return jax.random.categorical(key, sampling.safe_log(probs), shape=(k,))

  def child_law(self, draft_probs: Array, removed: Array, token: Array) -> Array:
    """q_u itself: draft_probs [vocab] (removed [vocab], token scalar unused)."""
    del removed, token
    return draft_probs


class WithoutReplacement(SiblingLaw):
  """Child j drawn from q_u without the earlier siblings' tokens, renormalised (RSD, Sequoia)."""
  name = "without_replacement"

  def _sample(self, key: Array, probs: Array, k: int) -> Array:
    """k distinct tokens [k] int: k sequential draws without replacement from probs [vocab].

    In the order drawn: Gumbel-top-k (Kool et al. 2019) is exactly that law.
    Zero-probability tokens score -inf and so come last, lowest id first.
    """
    perturbed = sampling.safe_log(probs) + jax.random.gumbel(key, probs.shape, jnp.float32)
    _, tokens = jax.lax.top_k(perturbed, k)
    return tokens

  def child_law(self, draft_probs: Array, removed: Array, token: Array) -> Array:
    """draft_probs [vocab] without the removed [vocab] tokens, renormalised (token unused).

    All zeros when no mass is left (`token.normalised_residual` with a zero
    fallback).
    """
    del token
    return token_verification.normalised_residual(jnp.where(removed, 0.0, draft_probs),
                                                  jnp.zeros_like(draft_probs))

  def after_try(self, removed: Array, tried: Array, token: Array) -> Array:
    """removed [vocab] bool plus `token` (int32 scalar) where tried (bool scalar)."""
    vocab_ids = jnp.arange(removed.shape[-1], dtype=jnp.int32)
    return removed | (tried & (vocab_ids == token))


class TopK(SiblingLaw):
  """The draft's k most likely tokens, fixed given its state: q^(j) is a point mass at x_j."""
  name = "topk"

  def _sample(self, key: Array, probs: Array, k: int) -> Array:
    """The top k [k] int of probs [vocab], most likely first, ties to lower ids (key unused)."""
    del key
    _, tokens = jax.lax.top_k(probs, k)
    return tokens

  def child_law(self, draft_probs: Array, removed: Array, token: Array) -> Array:
    """The one-hot [vocab] float32 at token (int32 scalar).

    draft_probs [vocab] gives only the vocabulary size; removed [vocab] is
    unused.
    """
    del removed
    vocab_ids = jnp.arange(draft_probs.shape[-1], dtype=jnp.int32)
    return (vocab_ids == token).astype(jnp.float32)


# The sibling-law registry: name -> law object. LAWS are its names.
TREE_LAWS: Dict[str, SiblingLaw] = {law.name: law for law in (IID(), WithoutReplacement(),
                                                              TopK())}
LAWS = tuple(TREE_LAWS)


def tree_law(law: str) -> SiblingLaw:
  """The SiblingLaw registered as `law` (a str in LAWS); ValueError listing LAWS otherwise."""
  if not isinstance(law, str) or law not in TREE_LAWS:
    raise ValueError(f"law must be one of {LAWS}, got {law!r}")
  return TREE_LAWS[law]


class TreeVerdict(NamedTuple):
  """What verifying one tree decided (leading [batch] when batched).

  path: [max_depth + 1] int32 slots: path[0] = 0 (the root), then the accepted
    nodes in depth order, -1 after the last one.
  num_accepted: int32 scalar, accepted drafts (the depth reached); the row
    emits tokens[path[1..num_accepted]] then next_token.
  next_token: int32 scalar, the correction drawn from the residual where
    every child was rejected, or the bonus drawn from the target at an
    accepted leaf.
  rank_tried: [max_children] int32, how many children of rank r were tried
    in this step (a rank is tried once all lower ranks of its node failed).
  rank_accepted: [max_children] int32, how many of those were accepted;
    rank_accepted / rank_tried estimates the per-rank acceptance a_r of
    `theory.tree_expected_tokens`.
  """
  path: Array
  num_accepted: Array
  next_token: Array
  rank_tried: Array
  rank_accepted: Array


def verify_tree(rng: Array, tokens: Array, parents: Array, ranks: Array, valid: Array,
                draft_probs: Array, target_probs: Array, *, law: str, greedy: bool = False,
                max_depth: int, max_children: int) -> TreeVerdict:
  """Keeps one root-to-node path of a drafted tree and draws the next token.

  Walks down from the root: at each node tries its children in increasing
  rank with the rule of the module docstring (accept x_j iff
  r * q^(j)(x_j) < p^(j)(x_j), r ~ U[0, 1), strict so that p(x) = 0 never
  accepts; one fresh uniform per decision), descends into the accepted one,
  and draws the next token where it stops. The emitted tokens are then
  distributed exactly as the target's own samples. (About 80 lines of code,
  kept whole: the walk is a `fori_loop` over depths around one over sibling
  ranks, whose carries (the node, the path, the residual law, the rank
  counters) read best in one place, as the module docstring's recursion.)

  Topology is data: children of node u are the valid slots v != u with
  parents[v] == u, so every row may have its own tree. Children whose rank is
  >= max_children, and nodes deeper than max_depth, are never visited (the
  walk then verifies the pruned tree, still exactly). Under "iid" and
  "without_replacement" a child whose q^(j)(x_j) = 0 could not have been drawn
  (a repeat under "without_replacement", or a zero-probability padding child)
  and is skipped, neither tried nor counted.

  Args:
    rng: PRNG key.
    tokens: [N] int32, tokens[0] the last emitted token (never verified).
    parents: [N] int32, parent slot of each node (-1 for the root and unused).
    ranks: [N] int32, the order in which siblings are tried (0 first).
    valid: [N] bool, False for unused slots (never tried, never accepted).
    draft_probs: [N, vocab] float32, q_u (adjusted): the law u's children were
      drawn from (rows of leaves and unused slots are ignored; ignored entirely
      under "topk" and greedy).
    target_probs: [N, vocab] float32, p_u (adjusted): the target's law of the
      token after node u.
    law: static, a name in LAWS (TREE_LAWS): how the children were drawn
      (module docstring).
    greedy: static; True when p is the temperature-0 one-hot: from the root
      follow the lowest-rank child whose token is argmax(p_u), stop where
      none is, next token = argmax at the last node. No noise is drawn and
      `law` and draft_probs are not used.
    max_depth: static int >= 0, the deepest node the walk may reach.
    max_children: static int >= 1, children per node tried at most (ranks
      0..max_children - 1).
  Returns:
    TreeVerdict (path [max_depth + 1], num_accepted, next_token,
    rank_tried [max_children], rank_accepted [max_children]).
  """
  sibling_law = tree_law(law)
  if int(max_depth) != max_depth or max_depth < 0:
    raise ValueError(f"max_depth must be an int >= 0, got {max_depth!r}")
  if int(max_children) != max_children or max_children < 1:
    raise ValueError(f"max_children must be an int >= 1, got {max_children!r}")
  if target_probs.ndim != 2:
    raise ValueError(f"target_probs must be [N, vocab], got {target_probs.shape}")
  n, vocab = target_probs.shape
  for name, array in (("tokens", tokens), ("parents", parents), ("ranks", ranks),
                      ("valid", valid)):
    if array.shape != (n,):
      raise ValueError(f"{name} must be [N] = {(n,)}, got {array.shape}")
  if draft_probs.shape != (n, vocab):
    raise ValueError(f"draft_probs must be [N, vocab] = {(n, vocab)}, got {draft_probs.shape}")
  draft_probs = jnp.asarray(draft_probs, jnp.float32)
  target_probs = jnp.asarray(target_probs, jnp.float32)
  tokens, parents, ranks = (jnp.asarray(a, jnp.int32) for a in (tokens, parents, ranks))
  valid = jnp.asarray(valid, jnp.bool_)
  accept_rng, next_rng = jax.random.split(rng)
  # One independent uniform per (depth, rank): every decision is fresh.
  uniforms = jax.random.uniform(accept_rng, (max_depth, max_children), dtype=jnp.float32)
  slots = jnp.arange(n, dtype=jnp.int32)
  rank_ids = jnp.arange(max_children, dtype=jnp.int32)

  # lax loops rather than Python ones: the program's size, and its compile
  # time, do not grow with max_depth * max_children.
  def visit(depth, carry):
    node, alive, stop_residual, path, rank_tried, rank_accepted = carry
    p_u, q_u = target_probs[node], draft_probs[node]
    is_child = valid & (parents == node) & (slots != node)
    of_rank = is_child[None, :] & (ranks[None, :] == rank_ids[:, None])  # [C, N]
    present = jnp.any(of_rank, axis=1)
    child_slots = jnp.argmax(of_rank, axis=1).astype(jnp.int32)  # first slot of each rank
    best = sampling.argmax(p_u) if greedy else None

    def try_child(rank, carry):
      residual, removed, chosen, rank_tried, rank_accepted = carry
      slot = child_slots[rank]
      token = tokens[slot]
      searching = alive & (chosen < 0) & present[rank]
      if greedy:
        tried = searching
        accepted = tried & (token == best)
      else:
        q = sibling_law.child_law(q_u, removed, token)
        q_x = q[token]
        tried = searching & (q_x > 0)
        accepted = tried & (uniforms[depth, rank] * q_x < residual[token])
        rejected = tried & ~accepted
        residual = jnp.where(rejected, sibling_law.residual(residual, q), residual)
        removed = sibling_law.after_try(removed, tried, token)
      chosen = jnp.where(accepted, slot, chosen)
      rank_tried = rank_tried.at[rank].add(tried.astype(jnp.int32))
      rank_accepted = rank_accepted.at[rank].add(accepted.astype(jnp.int32))
      return residual, removed, chosen, rank_tried, rank_accepted

    residual, _, chosen, rank_tried, rank_accepted = jax.lax.fori_loop(
        0, max_children, try_child,
        (p_u, jnp.zeros((vocab,), jnp.bool_), jnp.int32(-1), rank_tried, rank_accepted))
    stop_residual = jnp.where(alive & (chosen < 0), residual, stop_residual)
    alive = alive & (chosen >= 0)
    node = jnp.where(alive, chosen, node)
    path = path.at[depth + 1].set(jnp.where(alive, chosen, -1))
    return node, alive, stop_residual, path, rank_tried, rank_accepted

  zeros = jnp.zeros((max_children,), jnp.int32)
  start = (jnp.int32(0), jnp.bool_(True),  # node, and whether every node on the path was accepted
           target_probs[0],  # the law of next_token, set where the walk stops
           jnp.full((max_depth + 1,), -1, jnp.int32).at[0].set(0), zeros, zeros)
  node, alive, stop_residual, path, rank_tried, rank_accepted = jax.lax.fori_loop(
      0, max_depth, visit, start)
  # Accepted down to max_depth: the bonus comes from the target at the last node.
  stop_residual = jnp.where(alive, target_probs[node], stop_residual)
  if greedy:
    next_token = sampling.argmax(target_probs[node])
  else:
    next_token = sampling.sample(next_rng, stop_residual)
  return TreeVerdict(path=path, num_accepted=jnp.sum(path[1:] >= 0).astype(jnp.int32),
                     next_token=next_token.astype(jnp.int32), rank_tried=rank_tried,
                     rank_accepted=rank_accepted)


def batched_verify_tree(rngs: Array, tokens: Array, parents: Array, ranks: Array, valid: Array,
                        draft_probs: Array, target_probs: Array, *, law: str,
                        greedy: bool = False, max_depth: int, max_children: int) -> TreeVerdict:
  """`verify_tree` vmapped over the batch, each row with its own key and topology.

  Args:
    rngs: [batch] keys (one per row).
    tokens / parents / ranks / valid: [batch, N]; draft_probs / target_probs:
      [batch, N, vocab] (a `core.token_tree.Tree` row by row, probs its draft_probs).
    law, greedy, max_depth, max_children: static, see `verify_tree` (law a
      name in LAWS).
  Returns:
    TreeVerdict with a leading [batch] on every field.
  """
  step = functools.partial(verify_tree, law=law, greedy=greedy, max_depth=max_depth,
                           max_children=max_children)
  return jax.vmap(step)(rngs, tokens, parents, ranks, valid, draft_probs, target_probs)


def draw_children(rng: Array, probs: Array, k: int, law: str,
                  rank_scores: Optional[Array] = None) -> Tuple[Array, Array]:
  """Draws k children of one node from the draft's law there, in rank order.

  `TREE_LAWS[law].draw`:
  * "iid": k independent draws from probs (repeats possible, all valid).
  * "without_replacement": k distinct tokens, distributed as k sequential
    draws without replacement, in the order drawn: Gumbel-top-k (Kool et al.
    2019) is exactly that law.
  * "topk": the k most likely tokens, most likely first, ties to lower ids.
  * rank_scores given (greedy decoding, where the adjusted probs is a
    one-hot): the top k of rank_scores (e.g. the draft's raw log-softmax),
    whatever `law`; verification then matches tokens against the target's
    argmax and ignores probs.

  Siblings are distinct under "without_replacement" and "topk" (exactness of
  the former needs it). When probs has fewer than k non-zero entries those two
  laws run out of tokens: the last children are then zero-probability tokens,
  returned with valid False so that the caller marks their slots unused
  (`verify_tree` would skip them anyway, and no child of probability zero is
  ever accepted). Invalid children always come after the valid ones.

  Args:
    rng: PRNG key (unused for "topk" and rank_scores).
    probs: [vocab] float32, the draft's adjusted law at the node.
    k: static int >= 1; <= vocab unless law is "iid".
    law: static, a name in LAWS (TREE_LAWS).
    rank_scores: optional [vocab] float scores (greedy decoding).
  Returns:
    (tokens [k] int32, valid [k] bool: probs[token] > 0, or rank_scores[token]
    > -inf when rank_scores is given).
  """
  return tree_law(law).draw(rng, probs, k, rank_scores)
