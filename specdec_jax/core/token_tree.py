"""Token trees: their shape, their per-row topology, and how a block of tree nodes attends.

A tree iteration drafts several continuations at once. Node 0 (the root) is
the row's last emitted token; every other node is a drafted token whose
parent is the token before it. The target scores all nodes in one block call
with a tree attention mask, and verification keeps one root-to-node path.

Slot order is depth-first (pre-order), children in rank order (rank 0 = the
draft's first choice). So the *first path*, every node's first child, sits in
slots 0..D exactly as a chain of D drafts would: for a query on it, every
attended key lies at the cache index a chain puts it, every masked key is
masked in both, so its logits are the chain program's bit for bit. Keys of
other branches lie at other indices, and a reduction over the cache adds the
same terms in other places: equal to rounding, not bit for bit (measured:
XLA CPU float32 differs on most rows). Greedy decoding therefore emits only
tokens decided by first-path logits and carries the rest of an accepted
branch into the next iteration's first path (`core.tree_decoding`).

Positions: node i sits at absolute position root + depth(i), where root is
the position of the row's last emitted token; its keys and values are
written at cache index root + slot(i), and moved to root + depth(i) once its
path is accepted (`Family.move_cache`).
"""

import dataclasses
import functools
from typing import NamedTuple, Tuple

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TreeShape:
  """A static tree: every node at depth d - 1 has branching[d - 1] children.

  branching=(4, 2, 2, 1): the root has 4 children, each of those 2, ... down
  to depth 4. (1,) * gamma is a chain of gamma drafts. Arrays are numpy,
  in depth-first slot order (see the module docstring).
  """
  branching: Tuple[int, ...]

  def __post_init__(self):
    branching = self.branching
    if isinstance(branching, (int, np.integer)) or not hasattr(branching, "__len__"):
      raise ValueError(f"branching must be a sequence of ints (children per depth), got "
                       f"{branching!r}")
    if len(branching) == 0:
      raise ValueError("branching is empty: a tree needs at least one depth, e.g. (4, 2, 1)")
    for d, b in enumerate(branching):
      if isinstance(b, bool) or int(b) != b or b < 1:
        raise ValueError(f"branching[{d}] = {b!r}: every depth needs at least one child "
                         f"(an int >= 1), got branching={tuple(branching)!r}")
    object.__setattr__(self, "branching", tuple(int(b) for b in branching))

  @property
  def max_depth(self) -> int:
    return len(self.branching)

  @property
  def num_nodes(self) -> int:
    """Nodes including the root: the target block width the tree needs."""
    return int(1 + sum(np.cumprod(self.branching)))

  @functools.cached_property
  def _topology(self):
    parents, depths, ranks = [-1], [0], [0]

    def visit(node, depth):
      if depth == len(self.branching):
        return
      for rank in range(self.branching[depth]):
        child = len(parents)
        parents.append(node)
        depths.append(depth + 1)
        ranks.append(rank)
        visit(child, depth + 1)

    visit(0, 0)
    return (np.asarray(parents, np.int32), np.asarray(depths, np.int32),
            np.asarray(ranks, np.int32))

  @property
  def parents(self) -> np.ndarray:
    """[N] int32: each node's parent slot (-1 for the root)."""
    return self._topology[0]

  @property
  def depths(self) -> np.ndarray:
    """[N] int32: 0 for the root."""
    return self._topology[1]

  @property
  def ranks(self) -> np.ndarray:
    """[N] int32: a node's index among its siblings (0 for the root)."""
    return self._topology[2]

  @property
  def levels(self) -> Tuple[np.ndarray, ...]:
    """Slots at each depth 0..D, each in slot order (ascending)."""
    return tuple(np.flatnonzero(self.depths == d).astype(np.int32)
                 for d in range(self.max_depth + 1))

  @property
  def ancestors(self) -> np.ndarray:
    """[N, N] bool: [i, j] iff j is i or an ancestor of i."""
    return np.asarray(ancestors_from_parents(jnp.asarray(self.parents), self.max_depth))


class Tree(NamedTuple):
  """One tree per row, as a tree proposer returns it (static N slots, dynamic topology).

  tokens: [batch, N] int32, slot 0 the row's last emitted token.
  parents: [batch, N] int32, -1 for the root (and for unused slots).
  depths: [batch, N] int32.
  ranks: [batch, N] int32, the order in which verification tries siblings.
  valid: [batch, N] bool, False for unused slots (never accepted, never seen).
  probs: [batch, N, vocab] float32, the draft's adjusted law at each node: the
    distribution its children were drawn from (unused at leaves).
  """
  tokens: Array
  parents: Array
  depths: Array
  ranks: Array
  valid: Array
  probs: Array


class TreeAttention(NamedTuple):
  """How a block of tree nodes attends, per row (the `tree` argument of a block callback).

  A block callback `(tokens [batch, k], positions [batch], cache, tree)` writes
  block token i's keys/values at cache index positions + i, as without a tree.
  The row's tree root sits at cache index root = positions - root_offset, and
  tree slot j at root + j. Block token i:
  * sits at absolute position root + depths[i] (rotary angles, learned
    positions, relative-position buckets);
  * attends to every cache index c < root (the prefix, at position c, with the
    usual causal / sliding-window rule by position), to tree slot j iff
    visible[i, j] (a key at position root + slot_depths[j]), and to nothing at
    or past root + n.

  root_offset: [batch] int32, the tree slot of the block's first token (0 when
    the block is the whole tree).
  depths: [batch, k] int32.
  visible: [batch, k, n] bool; visible[i, root_offset + i] must be True (a
    token sees itself).
  slot_depths: [batch, n] int32, the depth of each tree slot.

  `chain_attention` describes a plain block: scoring with it is scoring
  without a tree, bit for bit.
  """
  root_offset: Array
  depths: Array
  visible: Array
  slot_depths: Array


def ancestors_from_parents(parents: Array, max_depth: int) -> Array:
  """[..., N] parent slots (-1 at the root) -> [..., N, N] bool ancestor-or-self matrix."""
  n = parents.shape[-1]
  eye = jnp.eye(n, dtype=jnp.bool_)
  anc = jnp.broadcast_to(eye, parents.shape + (n,))
  hop = jnp.broadcast_to(jnp.arange(n), parents.shape)  # node reached after d hops up
  for _ in range(max_depth):
    hop = jnp.where(hop >= 0, jnp.take_along_axis(parents, jnp.maximum(hop, 0), axis=-1), -1)
    anc = anc | ((hop[..., :, None] == jnp.arange(n)) & (hop[..., :, None] >= 0))
  return anc


def chain_attention(batch: int, k: int) -> TreeAttention:
  """A k-token causal block as a tree attention (a chain rooted at the block's first token)."""
  arange = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (batch, k))
  visible = jnp.broadcast_to(jnp.tril(jnp.ones((k, k), jnp.bool_)), (batch, k, k))
  return TreeAttention(jnp.zeros((batch,), jnp.int32), arange, visible, arange)


def whole_tree_attention(parents: Array, depths: Array, valid: Array, max_depth: int
                         ) -> TreeAttention:
  """The attention of a block that is the whole tree (the target's verification call).

  parents / depths / valid: [batch, N] (see `Tree`). Unused slots see only
  themselves and are seen by nobody.
  """
  batch, n = parents.shape
  visible = ancestors_from_parents(parents, max_depth)
  mask = valid[:, None, :] & valid[:, :, None]
  visible = (visible & mask) | jnp.eye(n, dtype=jnp.bool_)[None]
  return TreeAttention(jnp.zeros((batch,), jnp.int32), depths, visible, depths)


def tree_positions(tree: TreeAttention, positions: Array, cache_len: int):
  """Absolute positions of a tree block's queries and of every cache index.

  Args:
    tree: the block's TreeAttention (k tokens, n slots).
    positions: [batch] int32, cache index of the block's first token.
    cache_len: the cache's length L.
  Returns:
    (query_positions [batch, k] int32, key_positions [batch, L] int32,
     allowed [batch, k, L] bool): which cache indices each query may attend
     to before the family's own position rules (causal / sliding window),
     which it applies to query_positions and key_positions.
  """
  root = positions - tree.root_offset
  query_positions = root[:, None] + tree.depths
  index = jnp.arange(cache_len)[None, :]
  slot = index - root[:, None]  # [batch, L]
  n = tree.slot_depths.shape[1]
  in_tree = (slot >= 0) & (slot < n)
  slot_c = jnp.clip(slot, 0, n - 1)
  key_positions = jnp.where(in_tree, root[:, None] + jnp.take_along_axis(
      tree.slot_depths, slot_c, axis=1), index)
  sees_slot = jnp.take_along_axis(tree.visible, jnp.broadcast_to(
      slot_c[:, None, :], tree.visible.shape[:2] + (cache_len,)), axis=2)
  allowed = jnp.where(in_tree[:, None, :], sees_slot, (slot < 0)[:, None, :])
  return query_positions, key_positions, allowed
