"""Tree verification is exact: greedy path-for-path, sampling in distribution.

The sampling tests enumerate one tree step exactly with an independent numpy
reference (every way to draw the children, times the verification's
acceptance probabilities computed analytically) and check two things:
the reference's law of the emitted tokens, continued by the target, is the
target's own chain law p(x1) p(x2 | x1) p(x3 | x1 x2) exactly; and the jax
functions (children drawn by `draw_children`, verified by `verify_tree`,
200,000 rows) follow the reference's law of the emitted tokens and, continued
by the target, the chain law, by chi-square.

Chi-square checks run at a per-check false-alarm rate of 1e-4 (P_VALUE):
with the 16 such checks in this file a correct implementation fails
spuriously with probability about 2e-3. Power of `test_tree_step_is_exact`
at 200,000 rows, from the reference's exact laws under a wrong rule (the
noncentrality n * sum((p_wrong - p)^2 / p) over the test's cells): a stale
residual (every sibling tried against p_u) puts mass on outcomes of
probability zero in the emitted law (caught outright) and has noncentrality
>= 10,000 in the continued law; the SpecInfer rule (q^(j) = q_u) applied to
without-replacement or top-k children has >= 150,000 in the emitted law.
Power 0.99 at 1e-4 needs 62-87 (13-42 degrees of freedom), so these are
caught with power 1 - 1e-9 or more, and generally any rule whose effect
sum((p_wrong - p)^2 / p) on the emitted law is >= 4.4e-4 with power >= 0.99;
the test asserts its power against the wrong rules stays >= 0.99 (some
wrong rules coincide with the right one on particular laws, e.g. SpecInfer's
on without-replacement children when the residual left after the first
rejection is a point mass: the cases were chosen where they differ). The
two-sample chain test (100,000 rows each, ~146 degrees of freedom) resolves
an effect of about 3e-3 with power 0.99.
"""

import collections
import functools
import itertools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats
from test_speculative import chi_square_cells

from specdec_jax.core import token_tree as tree_lib
from specdec_jax.core.verification import token as speculative
from specdec_jax.core.verification import tree as tv

# `make test-slow` (CI runs it beside `make test`): the long statistical and method suites.
pytestmark = pytest.mark.slow

P_VALUE = 1e-4


def _cells(observed: dict, expected_probs: dict, n: int):
  """(observed, expected) counts over cells with expected count >= 5 (the rest lumped)."""
  return chi_square_cells(observed, expected_probs, n)


def _chi_square_pvalue(observed: dict, expected_probs: dict, n: int) -> float:
  obs, exp = _cells(observed, expected_probs, n)
  return scipy_stats.chisquare(obs, exp / exp.sum() * obs.sum(), sum_check=False).pvalue


def _power(wrong: dict, right: dict, n: int) -> float:
  """Power of `_chi_square_pvalue` at P_VALUE against samples from `wrong` (not `right`)."""
  if any(v > 1e-12 and right.get(k, 0.0) == 0 for k, v in wrong.items()):
    return 1.0  # a sample on an impossible outcome fails the test outright
  big = [k for k, v in right.items() if v * n >= 5]
  rest = 1.0 - sum(right[k] for k in big)
  rest_wrong = 1.0 - sum(wrong.get(k, 0.0) for k in big)
  effect = sum((wrong.get(k, 0.0) - right[k]) ** 2 / right[k] for k in big)
  if rest * n >= 5:
    effect += (rest_wrong - rest) ** 2 / rest
  df = len(big) - (0 if rest * n >= 5 else 1)
  return float(scipy_stats.ncx2.sf(scipy_stats.chi2.isf(P_VALUE, df), df, n * effect))


def _counts(rows: np.ndarray) -> collections.Counter:
  """[n, L] int rows, -1 padded -> Counter of tuples without the padding."""
  return collections.Counter(tuple(t for t in row if t >= 0) for row in rows.tolist())


# --------------------------------------------------------------------------
# The numpy reference: every drawn tree, verified analytically.

def _child_slots(parents: np.ndarray, ranks: np.ndarray):
  """[N] parents, ranks -> children slots of each node, in rank order."""
  children = [[] for _ in parents]
  for slot in np.argsort(ranks, kind="stable"):
    if parents[slot] >= 0:
      children[parents[slot]].append(int(slot))
  return children


def _draws(q: np.ndarray, k: int, law: str):
  """Every way to draw k children from q under `law`: [(tokens, probability)].

  A tuple is shorter than k where the law runs out of tokens of non-zero
  probability (`draw_children` marks the rest invalid).
  """
  support = [t for t in range(len(q)) if q[t] > 0]
  if law == "iid":
    return [(c, float(np.prod(q[list(c)]))) for c in itertools.product(support, repeat=k)]
  m = min(k, len(support))
  if law == "without_replacement":
    out = []
    for c in itertools.permutations(support, m):
      prob, left = 1.0, list(support)
      for t in c:
        prob *= q[t] / q[left].sum()
        left.remove(t)
      out.append((c, prob))
    return out
  order = sorted(support, key=lambda t: (-q[t], t))
  return [(tuple(order[:m]), 1.0)]


def _reference_verify(children, tokens, draft_at, target_at, law, bug=None):
  """Exact law of the emitted tokens of one drawn tree: {tuple of tokens: probability}.

  children[u]: u's present children slots in rank order; tokens[slot];
  draft_at(u) / target_at(u): q_u / p_u. `bug` swaps in a wrong rule, for the
  power computation: "stale_residual" tries every sibling against p_u and
  draws the correction from norm(max(p_u - q_u, 0)); "specinfer" verifies
  any children as if drawn i.i.d. from q_u.
  """
  law = "iid" if bug == "specinfer" else law
  out = collections.defaultdict(float)

  def visit(u, prefix, weight):
    p_u, q_u = target_at(u), draft_at(u)
    residual = p_u.copy()
    removed = np.zeros(len(p_u), bool)
    for c in children[u]:
      x = tokens[c]
      if law == "iid":
        q = q_u
      elif law == "without_replacement":
        q = np.where(removed, 0.0, q_u)
        q = q / q.sum()
      else:
        q = np.eye(len(p_u))[x]
      accept = min(1.0, residual[x] / q[x])
      if accept > 0:
        visit(c, prefix + (x,), weight * accept)
      weight *= 1.0 - accept
      if weight <= 0:
        return
      if bug != "stale_residual":
        rest = np.maximum(residual - q, 0.0)
        residual = rest / rest.sum()
      removed[x] = True
    if bug == "stale_residual" and children[u]:
      rest = np.maximum(p_u - q_u, 0.0)
      residual = rest / rest.sum()
    for t in range(len(p_u)):
      if residual[t] > 0:
        out[prefix + (t,)] += weight * residual[t]

  visit(0, (), 1.0)
  return out


class _Case:
  """A static tree shape, a target whose law depends only on the token path, and
  a draft whose law at a node depends on its slot and its token.

  target[prefix]: [V], the target's law after the tokens `prefix` (root excluded).
  draft: [N, V, V], draft[slot, token of slot]: the law that node's children
    are drawn from. The root's token is 0.
  """

  def __init__(self, branching, vocab, seed):
    self.shape = tree_lib.TreeShape(branching)
    self.vocab = vocab
    rng = np.random.RandomState(seed)
    depth = self.shape.max_depth

    def law(size):
      # Zeros both ways: the draft misses tokens the target likes, the target
      # forbids tokens the draft proposes.
      probs = rng.dirichlet(np.ones(vocab), size)
      probs[rng.uniform(size=probs.shape) < 0.25] = 0.0
      probs[np.arange(len(probs)), rng.randint(vocab, size=len(probs))] += 1e-3
      return probs / probs.sum(-1, keepdims=True)

    self.target = {}
    for d in range(depth + 1):
      for prefix, row in zip(itertools.product(range(vocab), repeat=d), law(vocab**d)):
        self.target[prefix] = row
    n = self.shape.num_nodes
    self.draft = law(n * vocab).reshape(n, vocab, vocab)
    # The root's law keeps one zero, so that 3 children without replacement
    # use up its support (the last one is then a point mass).
    root = rng.dirichlet(np.ones(vocab))
    root[1] = 0.0
    self.draft[0, 0] = root / root.sum()
    # One node law with a single token: its second child without replacement
    # or top-k is a zero-probability token, marked invalid.
    self.draft[1, 2] = np.eye(vocab)[3]
    self.children = _child_slots(self.shape.parents, self.shape.ranks)

  def path_tokens(self, tokens, slot):
    path = []
    while slot > 0:
      path.append(tokens[slot])
      slot = self.shape.parents[slot]
    return tuple(reversed(path))

  def drawn_trees(self, law):
    """Every drawn tree: [(tokens {slot: token}, present children per slot, probability)]."""
    out = []

    def expand(pending, tokens, children, prob):
      if not pending:
        out.append((dict(tokens), [list(c) for c in children], prob))
        return
      u, rest = pending[0], pending[1:]
      kids = self.children[u]
      if not kids:
        expand(rest, tokens, children, prob)
        return
      for drawn, p in _draws(self.draft[u, tokens[u]], len(kids), law):
        present = kids[:len(drawn)]
        tokens.update(zip(present, drawn))
        children[u] = present
        expand(rest + present, tokens, children, prob * p)
        children[u] = []
        for slot in present:
          del tokens[slot]

    expand([0], {0: 0}, [[] for _ in self.children], 1.0)
    return out

  def emitted_law(self, law, bug=None):
    """Exact law of the emitted tokens of one step: {tuple: probability}."""
    total = collections.defaultdict(float)
    for tokens, children, prob in self.drawn_trees(law):
      verdict = _reference_verify(
          children, tokens, lambda u: self.draft[u, tokens[u]],
          lambda u: self.target[self.path_tokens(tokens, u)], law, bug)
      for seq, p in verdict.items():
        total[seq] += prob * p
    return dict(total)

  def chain_law(self, length):
    """The target's own law of its first `length` tokens."""
    return {seq: float(np.prod([self.target[seq[:i]][seq[i]] for i in range(length)]))
            for seq in itertools.product(range(self.vocab), repeat=length)}

  def continued(self, emitted_law, length):
    """Law of the first `length` tokens when the target continues after the emitted ones."""
    out = collections.defaultdict(float)
    for seq, prob in emitted_law.items():
      for tail in itertools.product(range(self.vocab), repeat=length - len(seq)):
        full = seq + tail
        out[full] += prob * np.prod([self.target[full[:i]][full[i]]
                                     for i in range(len(seq), length)])
    return dict(out)

  def continue_samples(self, emitted: np.ndarray, seed: int) -> np.ndarray:
    """[n, L] emitted tokens, -1 padded -> [n, L] continued by sampling the target (numpy)."""
    rng = np.random.RandomState(seed)
    emitted = emitted.copy()
    vocab = self.vocab
    for i in range(emitted.shape[1]):
      todo = emitted[:, i] < 0
      prefix_index = np.zeros(len(emitted), np.int64)
      for j in range(i):
        prefix_index = prefix_index * vocab + emitted[:, j]
      table = np.stack([self.target[p] for p in itertools.product(range(vocab), repeat=i)])
      cdf = np.cumsum(table[prefix_index[todo]], axis=1)
      cdf[:, -1] = 1.0
      u = rng.uniform(size=(int(todo.sum()), 1))
      emitted[todo, i] = np.minimum(np.sum(cdf <= u, axis=1), vocab - 1)
    return emitted

  def sample(self, law, n, seed):
    """[n, max_depth + 1] emitted tokens (-1 padded) of n jax tree steps."""
    shape, vocab = self.shape, self.vocab
    num_nodes, depth = shape.num_nodes, shape.max_depth
    parents, ranks = jnp.asarray(shape.parents), jnp.asarray(shape.ranks)
    draft = jnp.asarray(self.draft, jnp.float32)
    # target_tables[d][flat index of the depth-d prefix] = p after that prefix.
    target_tables = [jnp.asarray(np.stack([self.target[p] for p in
                                           itertools.product(range(vocab), repeat=d)]),
                                 jnp.float32) for d in range(depth + 1)]
    paths = [self.path_tokens(list(range(num_nodes)), s) for s in range(num_nodes)]  # slots

    def row(key):
      draw_key, verify_key = jax.random.split(key)
      draw_keys = jax.random.split(draw_key, num_nodes)
      tokens = jnp.zeros((num_nodes,), jnp.int32)
      valid = jnp.ones((num_nodes,), jnp.bool_)
      for u, kids in enumerate(self.children):  # slot order: parents before children
        if kids:
          drawn, ok = tv.draw_children(draw_keys[u], draft[u, tokens[u]], len(kids), law)
          kids = jnp.asarray(kids)
          tokens = tokens.at[kids].set(drawn)
          valid = valid.at[kids].set(ok & valid[u])
      draft_probs = draft[jnp.arange(num_nodes), tokens]
      target_probs = []
      for slot in range(num_nodes):
        index = jnp.int32(0)
        for ancestor in paths[slot]:
          index = index * vocab + tokens[ancestor]
        target_probs.append(target_tables[len(paths[slot])][index])
      verdict = tv.verify_tree(verify_key, tokens, parents, ranks, valid, draft_probs,
                               jnp.stack(target_probs), law=law, max_depth=depth,
                               max_children=max(shape.branching))
      position = jnp.arange(depth + 1)
      on_path = tokens[jnp.roll(jnp.maximum(verdict.path, 0), -1)]
      return jnp.where(position < verdict.num_accepted, on_path,
                       jnp.where(position == verdict.num_accepted, verdict.next_token, -1))

    run = jax.jit(jax.vmap(row))
    return np.asarray(jax.device_get(run(jax.random.split(jax.random.PRNGKey(seed), n))))


_WRONG_RULES = {"iid": ("stale_residual",), "without_replacement": ("specinfer", "stale_residual"),
                "topk": ("specinfer", "stale_residual")}


@pytest.mark.parametrize("law", tv.LAWS)
@pytest.mark.parametrize("branching,seed", [((2, 2), 0), ((3, 1), 5)], ids=["2x2", "3x1"])
def test_tree_step_is_exact(law, branching, seed):
  case = _Case(branching, vocab=4, seed=seed)
  length = case.shape.max_depth + 1
  emitted_law = case.emitted_law(law)
  assert sum(emitted_law.values()) == pytest.approx(1.0, abs=1e-12)
  chain = case.chain_law(length)
  continued = case.continued(emitted_law, length)
  for seq, prob in chain.items():
    assert continued.get(seq, 0.0) == pytest.approx(prob, abs=1e-12), seq
  n = 200_000
  # Each wrong rule is wrong here, and the sample size below resolves it.
  for bug in _WRONG_RULES[law]:
    wrong = case.emitted_law(law, bug=bug)
    assert max(abs(case.continued(wrong, length).get(s, 0.0) - p)
               for s, p in chain.items()) > 1e-3, bug
    power = _power(wrong, emitted_law, n)
    assert power >= 0.99, f"power {power} against {bug}"

  emitted = case.sample(law, n, seed=100 + seed)
  assert _chi_square_pvalue(_counts(emitted), emitted_law, n) > P_VALUE
  full = case.continue_samples(emitted, seed=200 + seed)
  assert _chi_square_pvalue(_counts(full), chain, n) > P_VALUE


# --------------------------------------------------------------------------
# Greedy: the longest path that matches the target's argmax.

def _one_hot_targets(argmaxes, vocab):
  return jax.nn.one_hot(jnp.asarray(argmaxes), vocab, dtype=jnp.float32)


_GREEDY = functools.partial(tv.verify_tree, law="iid", greedy=True)


def _greedy(tokens, parents, ranks, valid, argmaxes, vocab=6, max_depth=3, max_children=3):
  n = len(tokens)
  draft = jnp.full((n, vocab), 1.0 / vocab)
  return jax.device_get(_GREEDY(
      jax.random.PRNGKey(0), jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32),
      jnp.asarray(ranks, jnp.int32), jnp.asarray(valid), draft,
      _one_hot_targets(argmaxes, vocab), max_depth=max_depth, max_children=max_children))


def test_greedy_follows_the_matching_child_and_takes_the_argmax_bonus():
  # Shape (2, 2): slots 0; 1 (1.1 = 2, 1.2 = 3); 4 (4.1 = 5, 4.2 = 6).
  shape = tree_lib.TreeShape((2, 2))
  parents, ranks = shape.parents, shape.ranks
  tokens = [0, 1, 2, 3, 4, 2, 5]
  valid = [True] * 7
  # The root wants 4 (its rank-1 child, slot 4), slot 4 wants 5 (slot 6, rank 1),
  # slot 6 wants 3: the bonus, both drafts accepted.
  v = _greedy(tokens, parents, ranks, valid, [4, 0, 0, 0, 5, 0, 3], max_depth=2, max_children=2)
  np.testing.assert_array_equal(v.path, [0, 4, 6])
  assert (v.num_accepted, v.next_token) == (2, 3)
  np.testing.assert_array_equal(v.rank_tried, [2, 2])
  np.testing.assert_array_equal(v.rank_accepted, [0, 2])
  # No child matches at slot 1: stop there, the correction is its argmax.
  v = _greedy(tokens, parents, ranks, valid, [1, 4, 0, 0, 0, 0, 0], max_depth=2, max_children=2)
  np.testing.assert_array_equal(v.path, [0, 1, -1])
  assert (v.num_accepted, v.next_token) == (1, 4)
  np.testing.assert_array_equal(v.rank_tried, [2, 1])
  np.testing.assert_array_equal(v.rank_accepted, [1, 0])
  # Nothing matches at the root.
  v = _greedy(tokens, parents, ranks, valid, [5, 1, 0, 0, 0, 0, 0], max_depth=2, max_children=2)
  np.testing.assert_array_equal(v.path, [0, -1, -1])
  assert (v.num_accepted, v.next_token) == (0, 5)
  # Slot 4's matching child unused: stop at slot 4 although the token matches.
  v = _greedy(tokens, parents, ranks, [True] * 6 + [False], [4, 0, 0, 0, 5, 0, 3],
              max_depth=2, max_children=2)
  np.testing.assert_array_equal(v.path, [0, 4, -1])
  assert (v.num_accepted, v.next_token) == (1, 5)


def test_greedy_ranks_not_slots_order_siblings():
  # The root's children in slots 1, 2, 3 with ranks 2, 0, 1; slots 1 and 3
  # both carry the target's token: the lower rank (slot 3) wins. Slot 4 (a
  # child of slot 3) and slot 5 (unused, a child of slot 3, would match) are
  # the rest; the tree is not in depth-first order.
  tokens = [0, 4, 2, 4, 1, 3]
  parents = [-1, 0, 0, 0, 3, 3]
  ranks = [0, 2, 0, 1, 0, 1]
  valid = [True, True, True, True, True, False]
  v = _greedy(tokens, parents, ranks, valid, [4, 0, 0, 3, 0, 0])
  np.testing.assert_array_equal(v.path, [0, 3, -1, -1])
  assert (v.num_accepted, v.next_token) == (1, 3)
  np.testing.assert_array_equal(v.rank_tried, [2, 1, 0])
  np.testing.assert_array_equal(v.rank_accepted, [0, 1, 0])
  # max_children=1 only ever tries rank 0 (slot 2): nothing matches.
  v = _greedy(tokens, parents, ranks, valid, [4, 0, 0, 3, 0, 0], max_children=1)
  np.testing.assert_array_equal(v.path, [0, -1, -1, -1])
  assert (v.num_accepted, v.next_token) == (0, 4)


# --------------------------------------------------------------------------
# Dynamic topology: every row its own tree.

def test_rows_with_different_topologies_in_one_batch():
  vocab = 6
  # Row 0: shape (2, 2) in depth-first order. Row 1: a root with three
  # children (slots 1, 2, 5; ranks 0, 1, 2), slot 2 with two (slots 3, 4) and
  # an unused slot 6 under slot 2 whose token would match.
  shape = tree_lib.TreeShape((2, 2))
  tokens = np.array([[0, 1, 2, 3, 4, 2, 1], [0, 3, 1, 2, 0, 4, 4]], np.int32)
  parents = np.array([shape.parents, [-1, 0, 0, 2, 2, 0, 2]], np.int32)
  ranks = np.array([shape.ranks, [0, 0, 1, 0, 1, 2, 2]], np.int32)
  valid = np.array([[True] * 7, [True] * 6 + [False]])
  argmaxes = np.array([[4, 0, 0, 0, 1, 0, 3], [1, 0, 4, 0, 0, 0, 0]])
  # One-hot targets make sampling deterministic too: a child is accepted iff
  # it is the target's token, and the residual stays that one-hot.
  target = _one_hot_targets(argmaxes, vocab)
  draft = jnp.full((2, 7, vocab), 1.0 / vocab)
  expected_path = [[0, 4, 6], [0, 2, -1]]
  expected = dict(num_accepted=[2, 1], next_token=[3, 4], rank_tried=[[2, 2], [2, 2]],
                  rank_accepted=[[0, 2], [0, 1]])
  keys = jax.random.split(jax.random.PRNGKey(3), 2)
  for law, greedy in [("iid", False), ("without_replacement", False), ("topk", False),
                      ("iid", True)]:
    batched = jax.device_get(tv.batched_verify_tree(
        keys, tokens, parents, ranks, valid, draft, target, law=law, greedy=greedy,
        max_depth=2, max_children=3))
    np.testing.assert_array_equal(batched.path, expected_path, err_msg=law)
    for name, value in expected.items():
      got = getattr(batched, name)
      if name.startswith("rank"):
        got = got[:, :2]
        np.testing.assert_array_equal(getattr(batched, name)[:, 2], [0, 0])
      np.testing.assert_array_equal(got, value, err_msg=f"{law} {name}")
    for row in range(2):
      alone = jax.device_get(tv.verify_tree(
          keys[row], tokens[row], parents[row], ranks[row], valid[row], draft[row], target[row],
          law=law, greedy=greedy, max_depth=2, max_children=3))
      for field in tv.TreeVerdict._fields:
        np.testing.assert_array_equal(getattr(alone, field), getattr(batched, field)[row])


# --------------------------------------------------------------------------
# A chain is the chain rule.

def test_chain_tree_has_the_law_of_speculative_step():
  vocab, gamma, n = 5, 3, 100_000
  rng = np.random.RandomState(4)
  p = rng.dirichlet(np.ones(vocab), gamma + 1)
  q = rng.dirichlet(np.ones(vocab), gamma)
  q[0, 1] = p[1, 0] = p[0, 2] = 0.0  # zeros both ways
  p = (p / p.sum(-1, keepdims=True)).astype(np.float32)
  q = (q / q.sum(-1, keepdims=True)).astype(np.float32)
  shape = tree_lib.TreeShape((1,) * gamma)
  # Slot i + 1 is draft i; the tree's q at slot i (which drew slot i + 1) is q_i.
  tree_q = jnp.asarray(np.concatenate([q, np.full((1, vocab), 1.0 / vocab, np.float32)]))

  @jax.jit
  def run(keys):
    def one(key):
      draft_key, chain_key, tree_key = jax.random.split(key, 3)
      drafts = jax.random.categorical(draft_key, jnp.log(jnp.asarray(q)))
      num_accepted, token = speculative.speculative_step(chain_key, drafts, jnp.asarray(q),
                                                         jnp.asarray(p))
      tokens = jnp.concatenate([jnp.zeros((1,), jnp.int32), drafts.astype(jnp.int32)])
      verdict = tv.verify_tree(tree_key, tokens, jnp.asarray(shape.parents),
                               jnp.asarray(shape.ranks), jnp.ones((gamma + 1,), jnp.bool_),
                               tree_q, jnp.asarray(p), law="iid", max_depth=gamma,
                               max_children=1)
      position = jnp.arange(gamma + 1)

      def emitted(accepted, next_token):
        padded = jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)])
        return jnp.where(position < accepted, padded,
                         jnp.where(position == accepted, next_token, -1))

      return (emitted(num_accepted, token), emitted(verdict.num_accepted, verdict.next_token),
              verdict)
    return jax.vmap(one)(keys)

  chain, tree, verdict = jax.device_get(run(jax.random.split(jax.random.PRNGKey(5), n)))
  np.testing.assert_array_equal(verdict.rank_accepted[:, 0], verdict.num_accepted)
  np.testing.assert_array_equal(verdict.rank_tried[:, 0],
                                np.minimum(verdict.num_accepted + 1, gamma))
  chain_counts, tree_counts = _counts(chain), _counts(tree)
  # Two-sample chi-square over the outcomes both samples see >= 5 times in expectation.
  pooled = {k: (chain_counts.get(k, 0) + tree_counts.get(k, 0)) / (2 * n)
            for k in set(chain_counts) | set(tree_counts)}
  obs_chain, _ = _cells(chain_counts, pooled, n)
  obs_tree, _ = _cells(tree_counts, pooled, n)
  table = np.stack([obs_chain, obs_tree])
  assert table.shape[1] > 50
  assert scipy_stats.chi2_contingency(table).pvalue > P_VALUE


# --------------------------------------------------------------------------
# Robustness on random topologies and awkward laws.

_VERIFY = {law: jax.jit(functools.partial(tv.verify_tree, law=law, max_depth=7,
                                          max_children=4)) for law in tv.LAWS}


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), law=st.sampled_from(tv.LAWS),
                  near_equal=st.booleans())
def test_never_nan_never_forbidden_token_on_random_trees(seed, law, near_equal):
  rng = np.random.RandomState(seed)
  n, vocab = 8, 5
  parents = np.array([-1] + [rng.randint(0, u) for u in range(1, n)], np.int32)
  ranks = np.zeros(n, np.int32)
  for u in range(n):
    kids = np.flatnonzero(parents == u)
    ranks[kids] = rng.permutation(len(kids))
  valid = rng.uniform(size=n) < 0.8
  valid[0] = True
  tokens = rng.randint(vocab, size=n).astype(np.int32)

  def laws():
    probs = rng.dirichlet(np.ones(vocab), n) * (rng.uniform(size=(n, vocab)) < 0.7)
    probs[np.arange(n), rng.randint(vocab, size=n)] += rng.choice([1e-30, 1e-3, 1.0], size=n)
    return probs / probs.sum(-1, keepdims=True)

  p = laws()
  q = p * (1 + 1e-7) if near_equal else laws()
  v = jax.device_get(_VERIFY[law](jax.random.PRNGKey(seed), tokens, parents, ranks, valid,
                                  q.astype(np.float32), p.astype(np.float32)))
  depth = int(v.num_accepted)
  assert v.path[0] == 0 and (v.path[depth + 1:] == -1).all() and (v.path[1:depth + 1] >= 0).all()
  for i in range(1, depth + 1):
    child, parent = v.path[i], v.path[i - 1]
    assert valid[child] and parents[child] == parent
    assert p[parent, tokens[child]] > 0, "accepted a token the target forbids"
  assert 0 <= v.next_token < vocab
  assert p[v.path[depth], v.next_token] > 0, "emitted a token the target forbids"
  assert (v.rank_accepted <= v.rank_tried).all() and v.rank_accepted.sum() == depth


def test_verify_tree_validates_arguments():
  probs = jnp.ones((3, 4)) / 4
  args = (jax.random.PRNGKey(0), jnp.zeros(3, jnp.int32), jnp.array([-1, 0, 0]),
          jnp.array([0, 0, 1]), jnp.ones(3, jnp.bool_), probs, probs)
  with pytest.raises(ValueError, match="law"):
    tv.verify_tree(*args, law="uniform", max_depth=1, max_children=2)
  with pytest.raises(ValueError, match="max_children"):
    tv.verify_tree(*args, law="iid", max_depth=1, max_children=0)
  with pytest.raises(ValueError, match="draft_probs"):
    tv.verify_tree(*args[:5], probs[:, :3], probs, law="iid", max_depth=1, max_children=2)
  with pytest.raises(ValueError, match="parents"):
    tv.verify_tree(args[0], args[1], args[2][:2], *args[3:], law="iid", max_depth=1,
                   max_children=2)


# --------------------------------------------------------------------------
# draw_children.

def _draw_many(probs, k, law, n, seed):
  draw = jax.jit(jax.vmap(functools.partial(tv.draw_children, probs=jnp.asarray(probs), k=k,
                                            law=law)))
  tokens, valid = draw(jax.random.split(jax.random.PRNGKey(seed), n))
  return np.asarray(tokens), np.asarray(valid)


def test_draw_children_iid_are_independent_draws():
  probs = np.array([0.1, 0.0, 0.5, 0.4], np.float32)
  n = 100_000
  tokens, valid = _draw_many(probs, 3, "iid", n, seed=0)
  assert valid.all()
  pairs = collections.Counter(map(tuple, tokens[:, :2].tolist()))
  expected = {(a, b): float(probs[a] * probs[b]) for a in range(4) for b in range(4)}
  assert _chi_square_pvalue(pairs, expected, n) > P_VALUE
  third = collections.Counter(tokens[:, 2].tolist())
  assert _chi_square_pvalue(third, dict(enumerate(probs.tolist())), n) > P_VALUE


def test_draw_children_without_replacement_is_sequential_sampling():
  probs = np.array([0.05, 0.15, 0.3, 0.5], np.float32)
  n = 100_000
  tokens, valid = _draw_many(probs, 3, "without_replacement", n, seed=1)
  assert valid.all()
  assert (np.sort(tokens, axis=1)[:, 1:] != np.sort(tokens, axis=1)[:, :-1]).all(), "repeats"
  # Ordered triples: prod_j q(x_j) / (1 - q(x_1) - ... - q(x_{j-1})).
  triples = collections.Counter(map(tuple, tokens.tolist()))
  expected = dict(_draws(probs.astype(np.float64), 3, "without_replacement"))
  assert len(expected) == 24
  assert _chi_square_pvalue(triples, expected, n) > P_VALUE
  # Fewer non-zero tokens than children: the extra child is invalid.
  sparse = np.array([0.0, 0.7, 0.0, 0.3], np.float32)
  tokens, valid = _draw_many(sparse, 3, "without_replacement", 1000, seed=2)
  np.testing.assert_array_equal(valid, np.broadcast_to([True, True, False], valid.shape))
  assert (np.sort(tokens[:, :2], axis=1) == [1, 3]).all()
  assert (sparse[tokens[:, 2]] == 0).all()
  firsts = collections.Counter(tokens[:, 0].tolist())
  assert 600 < firsts[1] < 800


def test_draw_children_topk_and_rank_scores():
  key = jax.random.PRNGKey(0)
  probs = jnp.array([0.2, 0.3, 0.2, 0.3, 0.0])
  tokens, valid = tv.draw_children(key, probs, 4, "topk")
  np.testing.assert_array_equal(tokens, [1, 3, 0, 2])  # ties to lower ids
  assert valid.all()
  tokens, valid = tv.draw_children(key, probs, 5, "topk")
  np.testing.assert_array_equal(tokens, [1, 3, 0, 2, 4])
  np.testing.assert_array_equal(valid, [True] * 4 + [False])
  # Greedy: q is the one-hot, the children come from the raw scores.
  scores = jnp.array([-1.0, -0.5, -3.0, -jnp.inf, -0.5])
  for law in tv.LAWS:
    tokens, valid = tv.draw_children(key, jax.nn.one_hot(1, 5), 4, law, rank_scores=scores)
    np.testing.assert_array_equal(tokens, [1, 4, 0, 2])
    assert valid.all()
  tokens, valid = tv.draw_children(key, jax.nn.one_hot(1, 5), 5, "iid", rank_scores=scores)
  np.testing.assert_array_equal(valid, [True] * 4 + [False])
  with pytest.raises(ValueError, match="exceed"):
    tv.draw_children(key, probs, 6, "without_replacement")
  with pytest.raises(ValueError, match="law"):
    tv.draw_children(key, probs, 2, "beam")
  assert tv.draw_children(key, probs, 8, "iid")[0].shape == (8,)
