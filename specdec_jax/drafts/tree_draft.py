"""`TreeDraft`: several continuations per iteration, verified in one target call.

Around any draft that gives a distribution at every node (a `ModelDraft`, an
`NgramDraft`): the inner draft's `tree_expander` scores nodes, this class
decides which tokens become nodes and lays them out.

Shape: static, `branching[d]` children for every node at depth d (so
(4, 2, 2, 1) proposes 4 first tokens, 2 continuations of each, ...). The
draft expands it breadth-first, one draft call per depth, writing depth d's
nodes contiguously into its own cache after the earlier depths; the target
sees it depth-first (`core.token_tree`), first path first. Children are drawn from
the inner draft's adjusted law q: i.i.d. ('iid', SpecInfer), without
replacement ('without_replacement', the default: distinct siblings, RSD /
Sequoia), or the deterministic top k ('topk'). Greedy decoding takes the
inner draft's k most likely tokens whatever the law (q is one-hot there).

Greedy pending tokens (`core.tree_decoding`) form the first path's start:
the tree's root is then the last pending token, the shape hangs below it,
and its last depth-first nodes that do not fit the width are dropped.
"""

from typing import Any, Hashable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.core import decoding
from specdec_jax.core.token_tree import Tree, TreeAttention, TreeShape, ancestors_from_parents
from specdec_jax.core.tree_decoding import TreeProposer
from specdec_jax.core import sampling
from specdec_jax.core.sampling import Sampling
from specdec_jax.core.verification import LAWS
from specdec_jax.core.verification import tree as tree_verification
from specdec_jax.drafts.base import Draft, ProposalPlan
from specdec_jax.families.registry import family_of

Array = jax.Array


class TreeExpander(NamedTuple):
  """How a draft scores tree nodes (`Draft.tree_expander`).

  start(state, sequences [batch, len + 1], lengths [batch], chain [batch, P],
    chain_len [batch]) -> (scores [batch, vocab], probs [batch, vocab], state):
    the draft's law after the row's tokens and the first chain_len tokens of
    `chain` (the greedy pending tokens, fed as a chain at positions lengths +
    1..chain_len). scores rank tokens for greedy children (log-probabilities
    at temperature 1); probs is the adjusted law q.
  expand(state, lengths [batch], chain_len [batch], tokens [batch, n],
    attention: TreeAttention, block_offset: int) -> (scores [batch, n, vocab],
    probs [batch, n, vocab], state): the laws after n nodes of the tree whose
    root is the chain's end, written at tree slots block_offset..+n-1 (cache
    positions lengths + chain_len + block_offset + i).
  move(state, lengths [batch], sources [batch, m]) -> state: the entries at
    positions lengths + t take those at lengths + sources[t] (see
    `Family.move_cache`); a draft without a cache returns state.
  init: None, or (state, batch, slots) -> state, once before the loop: a draft
    that keeps per-node arrays beside its cache adds them here, for the
    `slots` nodes one tree feeds it (tree slots 0..slots-1 of `expand`'s
    block_offset numbering; a feature head keeps its predicted features).
  """
  start: Any
  expand: Any
  move: Any
  init: Any = None


class _Layout(NamedTuple):
  """Static numpy tables of one tree shape, breadth-first (BFS) and depth-first (DFS)."""
  shape: TreeShape
  bfs_of_dfs: np.ndarray      # [N] BFS index of each DFS slot
  dfs_of_bfs: np.ndarray      # [N]
  bfs_parents: np.ndarray     # [N] (-1 at the root)
  bfs_depths: np.ndarray      # [N]
  bfs_visible: np.ndarray     # [N, N] ancestor-or-self, BFS indices
  level_starts: np.ndarray    # [D + 2] BFS index where each depth starts


def _layout(shape: TreeShape) -> _Layout:
  dfs_of_bfs = np.concatenate(shape.levels).astype(np.int32)
  bfs_of_dfs = np.argsort(dfs_of_bfs).astype(np.int32)
  parents = shape.parents[dfs_of_bfs]
  bfs_parents = np.where(parents >= 0, bfs_of_dfs[np.maximum(parents, 0)], -1).astype(np.int32)
  bfs_depths = shape.depths[dfs_of_bfs]
  visible = np.asarray(ancestors_from_parents(jnp.asarray(bfs_parents), shape.max_depth))
  starts = np.concatenate([[0], np.cumsum([len(level) for level in shape.levels])])
  return _Layout(shape, bfs_of_dfs, dfs_of_bfs, bfs_parents, bfs_depths, visible,
                 starts.astype(np.int32))


class _SubTree(NamedTuple):
  """A drafted tree below the chain's end, depth-first (slot 0 its root), per row [batch, n].

  tree: a `Tree` whose parents are slots of this sub-tree (-1 at its root)
    and whose probs are zeros at leaves; offsets: [batch, n] int32, where
    each node's draft keys/values lie, relative to the root's position.
  """
  tree: Tree
  offsets: Array


def _place(sub: _SubTree, last_token: Array, pending: Array, num_pending: Array, width: int):
  """The target's `Tree` of `width` slots: slot 0 the row's last token, 1..m the
  pending tokens, then the sub-tree's slot s >= 1 at m + s (dropped past the
  width; its depth-first order keeps every kept node's ancestors).

  Returns (Tree, offsets [batch, width]: each slot's draft keys/values,
  relative to the row's length).
  """
  offsets_in_sub, sub = sub.offsets, sub.tree
  n_sub = sub.tokens.shape[1]
  m = num_pending[:, None]
  slot = jnp.arange(width)[None, :]
  s = slot - m  # the sub-tree slot of each target slot (<= 0: the chain)
  in_sub = (s > 0) & (s < n_sub)
  s_c = jnp.clip(s, 0, n_sub - 1)
  take = lambda a: jnp.take_along_axis(a, s_c, axis=1)  # noqa: E731
  chain_token = jnp.take_along_axis(pending, jnp.clip(slot - 1, 0, pending.shape[1] - 1), axis=1)
  tokens = jnp.where(slot == 0, last_token[:, None], jnp.where(in_sub, take(sub.tokens),
                                                               chain_token))
  parents = jnp.where(in_sub, m + take(sub.parents), slot - 1)
  depths = jnp.where(in_sub, m + take(sub.depths), slot)
  ranks = jnp.where(in_sub, take(sub.ranks), 0)
  valid = (slot <= m) | (in_sub & take(sub.valid))
  # The chain's end (slot m) is the sub-tree's root and carries its law;
  # pending tokens before it carry none (greedy verification reads no q).
  probs = jnp.where(((slot == m) | in_sub)[:, :, None],
                    jnp.take_along_axis(sub.probs, s_c[:, :, None], axis=1), 0.0)
  offsets = jnp.where(in_sub | (slot == m), m + take(offsets_in_sub), slot)
  tree = Tree(tokens, jnp.where(valid, parents, -1), depths, ranks, valid, probs)
  return tree, offsets


def _check_depth(inner: Draft, depth: int) -> None:
  """A draft whose laws run out past some depth (`max_tree_depth`: Medusa's one head per
  level) cannot grow a deeper tree: an error naming both numbers."""
  limit = inner.max_tree_depth
  if limit is not None and depth > limit:
    raise ValueError(f"a tree of depth {depth} needs a head per level; this "
                     f"{type(inner).__name__} has {limit} (a shallower tree, or more heads)")


class TreeDraft(Draft):
  """A token tree around a draft that gives distributions.

  Args:
    draft: a `ModelDraft` (or a model), an `NgramDraft`, or any `Draft` with
      a `tree_expander`.
    branching: children per node at each depth, e.g. (4, 2, 2, 1); the tree
      has 1 + 4 + 8 + 16 + 16 = 45 slots with the root, and the target's
      block width must be at least that (`generate` says which to set).
    children: 'without_replacement' (default), 'iid' or 'topk' (see module).
  """

  def __init__(self, draft, branching: Sequence[int] = (4, 2, 2, 1), *,
               children: str = "without_replacement"):
    self._set_inner(draft)
    if children not in LAWS:
      raise ValueError(f"children must be one of {LAWS}, got {children!r}")
    self.shape = TreeShape(branching)
    self.children = children
    self.layout = _layout(self.shape)
    _check_depth(self.inner, self.shape.max_depth)

  def _set_inner(self, draft):
    from specdec_jax.drafts import as_draft  # the package imports this module
    self.inner = as_draft(draft)
    if isinstance(self.inner, TreeDraft):
      raise TypeError("a TreeDraft takes the draft that scores its nodes, not another TreeDraft")
    if type(self.inner).tree_expander is Draft.tree_expander:
      # The base method's error names the draft: raise it now, not in a trace.
      self.inner.tree_expander(None, Sampling())
    self.vocab_size = self.inner.vocab_size
    self.eos_id = self.inner.eos_id
    self.pad_id = self.inner.pad_id

  # A draft inside a tree reads from the target what it reads in a chain, and
  # observes the accepted path as it observes a chain's accepted drafts.
  @property
  def reads(self):
    return self.inner.reads

  @property
  def num_nodes(self) -> int:
    """Slots of one tree, root included: the smallest block width that holds it."""
    return self.shape.num_nodes

  @property
  def fed_slots(self) -> int:
    """Draft slots one tree writes (`expand`'s block_offset numbering, root 0)."""
    return self.shape.num_nodes

  @property
  def params(self) -> Any:
    return self.inner.params

  def static_key(self) -> Hashable:
    return ("tree", self.shape.branching, self.children, self.inner.compile_key())

  def check_compatible(self, target_config) -> None:
    self.inner.check_compatible(target_config)
    family_of(target_config).check_tree(self)  # the family must score token trees

  def check_verification(self, verification: str) -> None:
    if verification != "token":
      raise ValueError(f"verification={verification!r} verifies a chain; a "
                       f"{type(self).__name__} is verified by recursive rejection sampling over "
                       "its tree (its children's law): drop verification, or use a chain draft")

  def check_inputs(self, tokens, lengths, max_decode_steps: int) -> None:
    self.inner.check_inputs(tokens, lengths, max_decode_steps)

  def param_shardings(self, partitioner):
    return self.inner.param_shardings(partitioner)

  def constrain_state(self, state, partitioner):
    return dict(state, inner=self.inner.constrain_state(state["inner"], partitioner))

  def init_state(self, params, start):
    # The proposer's init adds the slots' draft offsets, once the width is known.
    return dict(inner=self.inner.init_state(params, start))

  def proposal_depth(self, sampling: Sampling, gamma: int, block_width: int) -> int:
    """The deepest node a tree can have: greedy pending tokens (up to D) precede the shape."""
    depth = self.depth
    return min(2 * depth if sampling.greedy else depth, block_width - 1)

  def block_slots(self, gamma: int) -> int:
    return self.num_nodes

  def describe_slots(self, gamma: int) -> str:
    return f"{self._describe()} has {self.num_nodes} slots (root included)"

  def calls_per_proposal(self, gamma: int) -> int:
    # One expansion per fed depth, and the root's start; a one-call drafter scores
    # every level from one call.
    return min(self.inner.calls_per_proposal(self.depth), self.depth)

  @property
  def depth(self) -> int:
    return self.shape.max_depth

  @property
  def max_children(self) -> int:
    return max(self.shape.branching)

  def law(self, greedy: bool) -> str:
    """How verification must read the siblings' laws."""
    return "topk" if greedy else self.children

  def _describe(self) -> str:
    return f"a tree of branching {self.shape.branching}"

  def proposer(self, params, plan: ProposalPlan) -> TreeProposer:
    """The loop's `TreeProposer` for a target block of `plan.block_width` slots."""
    width = plan.block_width
    decoding.resolve_block_width(width, slots=self.num_nodes, what=self.describe_slots(0))
    greedy = plan.sampling.greedy
    depth = self.proposal_depth(plan.sampling, plan.gamma, width)
    expander = self.inner.tree_expander_for(params, plan)

    def propose(rng, state, sequences, lengths, pending, num_pending):
      batch = sequences.shape[0]
      root_scores, root_probs, inner = expander.start(state["inner"], sequences, lengths,
                                                      pending, num_pending)
      root_token = jnp.where(
          num_pending > 0,
          jnp.take_along_axis(pending, jnp.maximum(num_pending - 1, 0)[:, None], axis=1)[:, 0],
          sequences[jnp.arange(batch), lengths])
      sub, inner = self._grow(rng, expander, inner, lengths, num_pending, root_token,
                              root_scores, root_probs, greedy)
      tree, offsets = _place(sub, sequences[jnp.arange(batch), lengths], pending, num_pending,
                             width)
      return tree, dict(state, inner=inner, offsets=offsets)

    def accept(state, lengths, path, kept):
      offsets = state["offsets"]
      depth = jnp.arange(path.shape[1])[None, :]
      sources = jnp.where(depth < kept[:, None],
                          jnp.take_along_axis(offsets, jnp.maximum(path, 0), axis=1), depth)
      return dict(state, inner=expander.move(state["inner"], lengths, sources))

    def init(state, batch):
      inner = (state["inner"] if expander.init is None else
               expander.init(state["inner"], batch, self.fed_slots))
      return dict(state, inner=inner, offsets=jnp.zeros((batch, width), jnp.int32))

    inner_observe = self.inner.observer(params)

    def observe(state, features, tokens, count):
      return dict(state, inner=inner_observe(state["inner"], features, tokens, count))

    return TreeProposer(init, propose, accept, self.law(greedy), depth, self.max_children, width,
                        None if inner_observe is None else observe)

  def _grow(self, rng, expander, inner, lengths, chain_len, root_token, root_scores, root_probs,
            greedy):
    """The static shape below the chain's end, drafted breadth-first: a `_SubTree`."""
    layout, shape = self.layout, self.shape
    batch, vocab = root_probs.shape
    n_sub = shape.num_nodes
    # Ranked by the draft's own scores: greedy (q is one-hot) and deterministic
    # top-k children, whose law is a point mass whatever q is.
    ranked = greedy or self.children == "topk"
    # Breadth-first: BFS index b holds tokens[:, b], probs[:, b] (q after it).
    tokens = jnp.zeros((batch, n_sub), jnp.int32).at[:, 0].set(root_token)
    node_valid = jnp.ones((batch, n_sub), jnp.bool_)
    probs = jnp.zeros((batch, n_sub, vocab), jnp.float32).at[:, 0].set(root_probs)
    level_scores, level_probs = root_scores[:, None], root_probs[:, None]
    rngs = sampling.split_keys(rng, shape.max_depth)
    for d in range(1, shape.max_depth + 1):
      start, stop = int(layout.level_starts[d]), int(layout.level_starts[d + 1])
      k = shape.branching[d - 1]
      parents_here = level_scores.shape[1]
      if sampling.is_row_keys(rngs[d - 1]):  # each row's children from its own key
        keys = jax.vmap(lambda key: jax.random.split(key, parents_here))(rngs[d - 1])
      else:
        keys = jax.random.split(rngs[d - 1], batch * parents_here).reshape(
            (batch, parents_here) + rngs.shape[1:])
      child_tokens, child_valid = jax.vmap(jax.vmap(
          lambda key, s, p: tree_verification.draw_children(
              key, p, k, self.children, rank_scores=s if ranked else None)))(
                  keys, level_scores, level_probs)
      child_tokens = child_tokens.reshape(batch, stop - start)
      parent_valid = node_valid[:, layout.bfs_parents[start:stop]]
      child_valid = child_valid.reshape(batch, stop - start) & parent_valid
      tokens = tokens.at[:, start:stop].set(child_tokens)
      node_valid = node_valid.at[:, start:stop].set(child_valid)
      if d < shape.max_depth:  # Leaves are never fed: nothing drafts below them.
        attention = TreeAttention(
            root_offset=jnp.full((batch,), start, jnp.int32),
            depths=jnp.full((batch, stop - start), d, jnp.int32),
            visible=jnp.broadcast_to(jnp.asarray(layout.bfs_visible[start:stop]),
                                     (batch, stop - start, n_sub)),
            slot_depths=jnp.broadcast_to(jnp.asarray(layout.bfs_depths), (batch, n_sub)))
        level_scores, level_probs, inner = expander.expand(
            inner, lengths, chain_len, child_tokens, attention, start)
        probs = probs.at[:, start:stop].set(level_probs)
    bfs = jnp.asarray(layout.bfs_of_dfs)
    broadcast = lambda a: jnp.broadcast_to(jnp.asarray(a), (batch, n_sub))  # noqa: E731
    sub = _SubTree(Tree(tokens[:, bfs], broadcast(shape.parents), broadcast(shape.depths),
                        broadcast(shape.ranks), node_valid[:, bfs], probs[:, bfs]),
                   broadcast(bfs))
    return sub, inner

  def room(self, width: int) -> int:
    """Positions past the decode that a tree iteration writes into the draft's cache."""
    return width + self.shape.max_depth + 2 + self.inner.room(width)

  def target_room(self, width: int) -> int:
    return width


class DynamicTreeDraft(TreeDraft):
  """A token tree grown by cumulative draft probability (EAGLE-2 style), within a node budget.

  At each depth 1..depth, the `topk` nodes of highest cumulative probability
  (the product of the draft's probabilities along their path, at
  temperature 1) are expanded, each by its `topk` most likely tokens; after
  the last depth the `node_budget - 1` best nodes of all those generated form
  the tree (with the root: node_budget slots; where topk and depth grow fewer
  candidates, topk + (depth - 1) topk^2, the tree holds all of them and
  `node_budget` is cut to that count + 1). A child never scores above
  its parent, so that choice keeps every chosen node's ancestors; nodes are
  then laid out depth-first, most likely child first, so the first path is
  the draft's greedy chain.

  Children are deterministic given the draft, so verification reads each as
  a point mass ('topk' law): exact at every temperature, and which nodes are
  kept depends on the draft alone, never on the target.
  """

  def __init__(self, draft, topk: int = 4, depth: int = 4, node_budget: int = 16):
    for name, value in (("topk", topk), ("depth", depth), ("node_budget", node_budget)):
      if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if node_budget < 2:
      raise ValueError(f"node_budget={node_budget} leaves no node beside the root: use >= 2")
    self._set_inner(draft)
    self.children = "topk"
    self.topk, self._depth = int(topk), int(depth)
    # A budget above what the tree can grow would leave slots no candidate fills.
    grown = self.topk + (self._depth - 1) * self.topk * self.topk
    self.node_budget = min(int(node_budget), 1 + grown)
    _check_depth(self.inner, self._depth)

  @property
  def num_nodes(self) -> int:
    return self.node_budget

  @property
  def fed_slots(self) -> int:
    return 1 + (self._depth - 1) * self.topk

  @property
  def depth(self) -> int:
    return self._depth

  @property
  def max_children(self) -> int:
    return self.topk

  def law(self, greedy: bool) -> str:
    return "topk"

  def _describe(self) -> str:
    return f"a dynamic tree of node_budget {self.node_budget}"

  def static_key(self) -> Hashable:
    return ("dynamic_tree", self.topk, self._depth, self.node_budget, self.inner.compile_key())

  def room(self, width: int) -> int:
    return width + self._depth * self.topk + 2 + self.inner.room(width)

  def _grow(self, rng, expander, inner, lengths, chain_len, root_token, root_scores, root_probs,
            greedy):
    k, depth, budget = self.topk, self._depth, self.node_budget
    batch, vocab = root_probs.shape
    rows = jnp.arange(batch)[:, None]
    # The draft's cache: slot 0 the root, depth d's expanded nodes at
    # 1 + (d - 1) k .. d k (the last depth is never fed).
    n_fed = 1 + (depth - 1) * k
    fed_depths = jnp.asarray(np.concatenate([[0], np.repeat(np.arange(1, depth), k)]), jnp.int32)
    base = k + 1  # a node's depth-first key: its ranks path in base k + 1
    # Candidates, in generation order: [batch, C].
    tokens, parents, ranks, depths, cums, keys, fed = [], [], [], [], [], [], []
    fed_probs = jnp.zeros((batch, n_fed, vocab), jnp.float32).at[:, 0].set(root_probs)
    # The nodes expanded at the previous depth (candidate ids, -1 = root).
    frontier_id = jnp.full((batch, 1), -1, jnp.int32)
    frontier_cum = jnp.zeros((batch, 1), jnp.float32)
    frontier_key = jnp.zeros((batch, 1), jnp.int32)
    frontier_vis = jnp.zeros((batch, 1, n_fed), jnp.bool_).at[:, :, 0].set(True)
    frontier_scores = root_scores[:, None]
    count = 0
    for d in range(1, depth + 1):
      width_here = frontier_id.shape[1]
      child_scores, child_tokens = jax.lax.top_k(frontier_scores, k)  # [batch, f, k]
      cum = frontier_cum[:, :, None] + child_scores
      key = frontier_key[:, :, None] + (jnp.arange(k, dtype=jnp.int32) + 1)[None, None] * (
          base ** (depth - d))
      tokens.append(child_tokens.reshape(batch, -1).astype(jnp.int32))
      parents.append(jnp.broadcast_to(frontier_id[:, :, None], cum.shape).reshape(batch, -1))
      ranks.append(jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), cum.shape).reshape(batch, -1))
      depths.append(jnp.full((batch, width_here * k), d, jnp.int32))
      cums.append(cum.reshape(batch, -1))
      keys.append(key.reshape(batch, -1))
      fed_here = jnp.zeros((batch, width_here * k), jnp.int32)
      if d < depth:
        # Expand the k best of this depth: fed to the draft as one block.
        flat_cum = cum.reshape(batch, -1)
        best_cum, best = jax.lax.top_k(flat_cum, k)
        slot0 = 1 + (d - 1) * k
        own = jax.nn.one_hot(slot0 + jnp.arange(k), n_fed, dtype=jnp.bool_)[None]
        parent_vis = jnp.take_along_axis(frontier_vis, (best // k)[:, :, None], axis=1)
        frontier_vis = parent_vis | own
        frontier_tokens = jnp.take_along_axis(tokens[-1], best, axis=1)
        attention = TreeAttention(
            root_offset=jnp.full((batch,), slot0, jnp.int32),
            depths=jnp.full((batch, k), d, jnp.int32), visible=frontier_vis,
            slot_depths=jnp.broadcast_to(fed_depths, (batch, n_fed)))
        frontier_scores, probs_here, inner = expander.expand(
            inner, lengths, chain_len, frontier_tokens, attention, slot0)
        fed_probs = fed_probs.at[:, slot0:slot0 + k].set(probs_here)
        fed_here = fed_here.at[rows, best].set(slot0 + jnp.arange(k, dtype=jnp.int32))
        frontier_id = count + best.astype(jnp.int32)
        frontier_cum = best_cum
        frontier_key = jnp.take_along_axis(keys[-1], best, axis=1)
      fed.append(fed_here)
      count += width_here * k
    tokens, parents, ranks, depths, cums, keys, fed = (
        jnp.concatenate(a, axis=1) for a in (tokens, parents, ranks, depths, cums, keys, fed))
    # The budget's best nodes: highest cumulative log-probability, parents
    # before children on ties (a child can only tie a parent of probability 1).
    usable = cums > -jnp.inf
    order = jnp.lexsort((depths, jnp.where(usable, -cums, jnp.inf)), axis=-1)
    chosen = jnp.zeros_like(usable).at[rows, order[:, :budget - 1]].set(True) & usable
    # Depth-first: ascending ranks-path key; the unchosen go last.
    big = jnp.iinfo(jnp.int32).max
    dfs = jnp.argsort(jnp.where(chosen, keys, big), axis=1, stable=True)[:, :budget - 1]
    slot_of = jnp.zeros_like(keys).at[rows, dfs].set(jnp.arange(1, budget, dtype=jnp.int32))
    take = lambda a: jnp.take_along_axis(a, dfs, axis=1)  # noqa: E731
    parent_slot = jnp.where(take(parents) >= 0, jnp.take_along_axis(
        slot_of, jnp.maximum(take(parents), 0), axis=1), 0)
    pad = lambda root, a: jnp.concatenate([jnp.full((batch, 1), root, a.dtype), a], axis=1)  # noqa
    fed_slot = take(fed)
    probs = jnp.where((fed_slot > 0)[:, :, None],
                      jnp.take_along_axis(fed_probs, fed_slot[:, :, None], axis=1), 0.0)
    sub = _SubTree(Tree(
        tokens=jnp.concatenate([root_token[:, None], take(tokens)], axis=1),
        parents=pad(-1, parent_slot), depths=pad(0, take(depths)), ranks=pad(0, take(ranks)),
        valid=pad(True, take(chosen)),
        probs=jnp.concatenate([root_probs[:, None], probs], axis=1)), offsets=pad(0, fed_slot))
    return sub, inner
