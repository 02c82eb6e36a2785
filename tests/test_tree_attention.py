"""Tree attention in both families: one block call scores every node of a token tree.

The contract (`core/token_tree.py`, `families/base.py`): `block_fn(tokens, positions,
cache, tree)` sets block token i's keys/values at cache index positions + i,
puts token i at absolute position root + tree.depths[i] and lets it attend to
the prefix and to the tree slots it sees. Checked here after a prefix already
in the cache, on T5 (both fused attention variants) and decoder-only models
(Llama, GPT-2's learned positions, Gemma-2 and Mistral sliding windows shorter
than the cache, so the windows cut into the tree), float32:

* `chain_attention` is tree=None, logits and cache bit for bit (bfloat16 too);
* a random tree's logits on every root-to-leaf path are that path's logits
  scored as a plain chain; on the first path bit for bit;
* scoring the tree depth by depth (BFS slots, a draft model's expansion) is
  the whole-tree call;
* `Family.move_cache` after accepting a non-first path gives the chain's cache;
* a family without tree support refuses a tree by name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax
from specdec_jax.core.token_tree import (TreeAttention, TreeShape, ancestors_from_parents,
                                   chain_attention, whole_tree_attention)
from specdec_jax.families.base import call_block, shift_block_fn
from specdec_jax.families.decoder_only.config import DecoderOnlyConfig, get_decoder_config
from specdec_jax.families.decoder_only.family import DecoderOnlyFamily
from specdec_jax.families.registry import family_of
from specdec_jax.families.t5 import decode as t5_decode

SHAPE = TreeShape((3, 2, 2))  # 22 nodes, 12 leaves, depth 3.
PREFIX = 5  # Loop positions scored as a chain before the tree.
BATCH = 2


def _gemma2_config(dtype="float32"):
  """Gemma 2 layout (soft-caps, sandwich norms, scaled embeddings), a sliding layer
  of window 2 then a full layer. The window cuts into the tree: a depth-3 node
  does not see its depth-1 ancestor, whose cache index (its slot) may lie
  inside the window while its position does not, so the window must compare
  positions, not indices."""
  return DecoderOnlyConfig(
      family="gemma2", vocab_size=97, emb_dim=32, num_layers=2, num_heads=2,
      num_kv_heads=1, head_dim=16, mlp_dim=64, max_positions=128, norm_epsilon=1e-6,
      activation="gelu_new", tie_word_embeddings=True, norm_offset=1.0, scale_embeddings=True,
      sandwich_norms=True, query_pre_attn_scalar=16.0, attn_logit_softcap=5.0,
      final_logit_softcap=6.0, sliding_window=2,
      layer_types=("sliding_attention", "full_attention"), bos_id=1, eos_id=2, pad_id=0,
      dtype=dtype)


def _model(name, dtype="float32"):
  if name == "gemma2_window":
    return specdec_jax.load_model(_gemma2_config(dtype), seed=3, dtype=dtype)
  if name == "mistral_window":  # Llama layout, window 3 on every layer (cuts the prefix).
    return specdec_jax.load_model(get_decoder_config("llama_tiny", family="mistral",
                                                     sliding_window=3), seed=4, dtype=dtype)
  return specdec_jax.load_model(name, seed=1, dtype=dtype)


DECODER_ONLY = ["llama_tiny", "gpt2_tiny", "gemma2_window", "mistral_window"]
# (model name, T5 attention variant or None for the family's block_fn).
CASES = [("tiny", "dots"), ("tiny", "in_layout")] + [(name, None) for name in DECODER_ONLY]


class Setup:
  """A model's decode started (T5: encoded; decoder-only: ragged prompts prefilled),
  then PREFIX loop positions scored as a chain; blocks run at loop positions."""

  def __init__(self, name, attention=None, dtype="float32"):
    self.model = _model(name, dtype)
    self.family = family_of(self.model)
    config, params = self.model.config, self.model.params
    self.vocab = config.vocab_size
    rng = np.random.RandomState(0)
    width = 7
    tokens = rng.randint(3, self.vocab, (BATCH, width)).astype(np.int32)
    lengths = np.array([width, 4], np.int32)
    if self.family.name == "t5":
      tokens[1, 4:] = config.pad_id
    tokens, lengths = self.family.check_inputs(config, tokens, None if self.family.name == "t5"
                                               else lengths, 40)
    steps = PREFIX + SHAPE.num_nodes + 2
    start = jax.jit(lambda t, n: self.family.start(config, params, t, n, steps))(tokens, lengths)
    if attention is None:
      block = self.family.block_fn(config, params)
    else:
      block = t5_decode.block_fn(params, config, attention)
    self.block = shift_block_fn(block, start.offset)
    self.offset = np.asarray(start.offset)
    self.calls = {}
    prefix = rng.randint(3, self.vocab, (BATCH, PREFIX)).astype(np.int32)
    prefix[:, 0] = np.asarray(start.first_inputs)
    _, self.cache = self(prefix, np.zeros(BATCH, np.int32), start.cache)
    self.root = np.full(BATCH, PREFIX, np.int32)  # Loop position of the tree root.
    self.rng = rng

  def __call__(self, tokens, positions, cache, tree=None):
    """The block at loop positions, jitted once per shape and tree structure."""
    key = (tokens.shape, tree is None)
    if key not in self.calls:
      self.calls[key] = jax.jit(lambda t, p, c, tr: call_block(self.block, t, p, c, tr))
    return self.calls[key](jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                           cache, tree)

  def tree_tokens(self):
    tokens = self.rng.randint(3, self.vocab, (BATCH, SHAPE.num_nodes)).astype(np.int32)
    return tokens

  def self_attention_leaves(self, cache):
    marks = self.family.self_attention_cache(cache)
    leaves = jax.tree_util.tree_leaves(cache)
    flags = jax.tree_util.tree_leaves(marks)
    return [(leaf, flag) for leaf, flag in zip(leaves, flags)]

  def cache_index(self, loop_positions):
    """Cache index of loop positions (the absolute position: offset + loop position)."""
    return self.offset + loop_positions


def _whole_tree():
  parents = jnp.broadcast_to(jnp.asarray(SHAPE.parents), (BATCH, SHAPE.num_nodes))
  depths = jnp.broadcast_to(jnp.asarray(SHAPE.depths), (BATCH, SHAPE.num_nodes))
  valid = jnp.ones((BATCH, SHAPE.num_nodes), jnp.bool_)
  return whole_tree_attention(parents, depths, valid, SHAPE.max_depth)


def _paths():
  """Every root-to-leaf path, as tree slots (depth-first order: the first is 0..D)."""
  parents = SHAPE.parents
  leaves = [i for i in range(SHAPE.num_nodes) if i not in set(parents.tolist())]
  paths = []
  for leaf in leaves:
    path = [leaf]
    while parents[path[-1]] >= 0:
      path.append(int(parents[path[-1]]))
    paths.append(path[::-1])
  return paths


def _assert_trees_equal(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


_SETUPS = {}


def _setup(name, attention, dtype="float32"):
  key = (name, attention, dtype)
  if key not in _SETUPS:
    _SETUPS[key] = Setup(name, attention, dtype)
  return _SETUPS[key]


@pytest.mark.parametrize("name,attention", CASES)
def test_chain_attention_is_no_tree_bit_for_bit(name, attention):
  s = _setup(name, attention)
  tokens = s.tree_tokens()
  want_logits, want_cache = s(tokens, s.root, s.cache)
  got_logits, got_cache = s(tokens, s.root, s.cache, chain_attention(BATCH, tokens.shape[1]))
  np.testing.assert_array_equal(np.asarray(got_logits), np.asarray(want_logits))
  _assert_trees_equal(got_cache, want_cache)


@pytest.mark.parametrize("name,attention", CASES)
def test_tree_paths_score_as_chains(name, attention):
  s = _setup(name, attention)
  tokens = s.tree_tokens()
  tree_logits, _ = s(tokens, s.root, s.cache, _whole_tree())
  tree_logits = np.asarray(tree_logits)
  paths = _paths()
  assert paths[0] == list(range(SHAPE.max_depth + 1))
  scale = np.abs(tree_logits).max()
  for i, path in enumerate(paths):
    chain_logits, _ = s(tokens[:, path], s.root, s.cache)
    chain_logits = np.asarray(chain_logits)
    np.testing.assert_allclose(tree_logits[:, path], chain_logits, rtol=1e-5,
                               atol=1e-5 * scale, err_msg=f"path {path}")
  # The first path bit for bit, against the chain program of the tree's width
  # (the first path, then tokens after it that no query on it sees): each of
  # its queries attends to the keys at the very cache indices a chain puts
  # them, and every other index is masked in both, so every reduction adds
  # the same terms in the same places. A query on another path attends to
  # keys of the same values but at other cache indices (its ancestors are
  # not contiguous in slot order), so the reductions over the cache add the
  # same terms in other places: equal to float rounding only. The width
  # matters too: against a chain block of D + 1 tokens the first path is only
  # close (measured on XLA CPU: ~1e-6 apart), products of other shapes rounding
  # differently; bit for bit holds against a block of the tree's width.
  first = paths[0]
  chain = np.concatenate([tokens[:, first], tokens[:, len(first):]], axis=1)
  chain_logits, _ = s(chain, s.root, s.cache)
  np.testing.assert_array_equal(tree_logits[:, first], np.asarray(chain_logits)[:, first])


def _bfs():
  """(BFS order of the depth-first slots, BFS parents, BFS depths, level bounds)."""
  order = np.concatenate(SHAPE.levels)
  where = np.argsort(order)  # depth-first slot -> BFS slot
  parents = np.where(SHAPE.parents[order] >= 0, where[np.maximum(SHAPE.parents[order], 0)], -1)
  bounds = np.cumsum([0] + [len(level) for level in SHAPE.levels])
  return order, parents.astype(np.int32), SHAPE.depths[order], bounds


@pytest.mark.parametrize("name,attention", CASES)
def test_tree_scored_depth_by_depth_equals_the_whole_tree(name, attention):
  """A draft model's expansion: each block is one depth's nodes, set after the
  earlier depths (BFS slots), seeing every slot written so far."""
  s = _setup(name, attention)
  tokens = s.tree_tokens()
  whole, _ = s(tokens, s.root, s.cache, _whole_tree())
  whole = np.asarray(whole)
  order, parents, depths, bounds = _bfs()
  visible = np.asarray(ancestors_from_parents(jnp.asarray(parents), SHAPE.max_depth))
  bfs_tokens = tokens[:, order]
  cache = s.cache
  got = np.zeros_like(whole)
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    lo, hi = int(lo), int(hi)
    tree = TreeAttention(
        root_offset=jnp.full((BATCH,), lo, jnp.int32),
        depths=jnp.broadcast_to(jnp.asarray(depths[lo:hi]), (BATCH, hi - lo)),
        visible=jnp.broadcast_to(jnp.asarray(visible[lo:hi, :hi]), (BATCH, hi - lo, hi)),
        slot_depths=jnp.broadcast_to(jnp.asarray(depths[:hi]), (BATCH, hi)))
    logits, cache = s(bfs_tokens[:, lo:hi], s.root + lo, cache, tree)
    got[:, order[lo:hi]] = np.asarray(logits)
  np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5 * np.abs(whole).max())


@pytest.mark.parametrize("name,attention", CASES)
def test_move_cache_puts_an_accepted_path_in_chain_order(name, attention):
  s = _setup(name, attention)
  tokens = s.tree_tokens()
  _, tree_cache = s(tokens, s.root, s.cache, _whole_tree())
  paths = _paths()
  # Per row a different non-first path (the last one, a middle one).
  accepted = np.array([paths[-1], paths[len(paths) // 2]], np.int32)
  assert all(list(p) != paths[0] for p in accepted)
  root = s.cache_index(s.root)
  move = jax.jit(s.family.move_cache)
  moved = move(tree_cache, root, accepted)
  chain_tokens = np.take_along_axis(tokens, accepted, axis=1)
  _, chain_cache = s(chain_tokens, s.root, s.cache)
  m = accepted.shape[1]
  for (got, moves), (before, _), (want, _) in zip(s.self_attention_leaves(moved),
                                                  s.self_attention_leaves(tree_cache),
                                                  s.self_attention_leaves(chain_cache)):
    got, before, want = np.asarray(got), np.asarray(before), np.asarray(want)
    if not moves:  # Cross-attention keys/values, the encoder mask.
      np.testing.assert_array_equal(got, before)
      continue
    axis = 1 if s.family.name == "decoder_only" else 2
    got, before, want = (np.moveaxis(x, axis, 1).astype(np.float32) for x in (got, before, want))
    for b in range(BATCH):
      window = slice(root[b], root[b] + m)
      np.testing.assert_allclose(got[b, window], want[b, window], rtol=1e-5,
                                 atol=1e-5 * np.abs(want).max())
      outside = np.ones(got.shape[1], bool)
      outside[window] = False
      np.testing.assert_array_equal(got[b, outside], before[b, outside])
  # The next token scores the same from the moved cache as from the chain's.
  after = s.rng.randint(3, s.vocab, (BATCH, 2)).astype(np.int32)
  want, _ = s(after, s.root + m, chain_cache)
  got, _ = s(after, s.root + m, moved)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                             atol=1e-5 * np.abs(np.asarray(want)).max())
  # The first path is already in place: moving it changes nothing.
  first = np.broadcast_to(np.arange(m, dtype=np.int32), (BATCH, m))
  _assert_trees_equal(move(tree_cache, root, first), tree_cache)


@pytest.mark.parametrize("name", ["tiny", "llama_tiny"])
def test_model_decode_block_takes_a_tree(name):
  """`Model.decode_block` / `DecoderOnlyModel.decode_block` (absolute positions)
  forward a tree to the same step as the family's callback."""
  s = _setup(name, None)
  tokens = s.tree_tokens()
  want, want_cache = s(tokens, s.root, s.cache, _whole_tree())
  got, got_cache = s.model.decode_block(tokens, s.cache_index(s.root), s.cache, _whole_tree())
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5,
                             atol=1e-5 * np.abs(np.asarray(want)).max())
  for x, y in zip(jax.tree_util.tree_leaves(got_cache), jax.tree_util.tree_leaves(want_cache)):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-5,
                               atol=1e-5 * max(1.0, float(np.abs(np.asarray(y, np.float32)).max())))


def test_move_cache_reads_before_writing_and_drops_past_the_end():
  """On a bare decoder-only cache of known values: slots read from the old
  cache, writes past the end dropped, reads past it clamped."""
  family = family_of(get_decoder_config("llama_tiny"))
  length = 10
  values = np.arange(2 * length * 2 * 3, dtype=np.float32).reshape(2, length, 2, 3)
  cache = dict(layers=[dict(self_key=jnp.asarray(values), self_value=jnp.asarray(-values))])
  positions = np.array([2, 8], np.int32)
  sources = np.array([[0, 3, 1, 2], [0, 1, 3, 2]], np.int32)
  moved = family.move_cache(cache, positions, sources)
  want = values.copy()
  for b in range(2):
    for t in range(sources.shape[1]):
      if positions[b] + t < length:
        want[b, positions[b] + t] = values[b, min(positions[b] + sources[b, t], length - 1)]
  np.testing.assert_array_equal(np.asarray(moved["layers"][0]["self_key"]), want)
  np.testing.assert_array_equal(np.asarray(moved["layers"][0]["self_value"]), -want)


@pytest.mark.parametrize("name,attention", [("tiny", "dots"), ("tiny", "in_layout"),
                                            ("llama_tiny", None), ("gemma2_window", None)])
def test_chain_attention_is_no_tree_bit_for_bit_in_bfloat16(name, attention):
  s = _setup(name, attention, "bfloat16")
  tokens = s.tree_tokens()
  want_logits, want_cache = s(tokens, s.root, s.cache)
  got_logits, got_cache = s(tokens, s.root, s.cache, chain_attention(BATCH, tokens.shape[1]))
  np.testing.assert_array_equal(np.asarray(got_logits), np.asarray(want_logits))
  _assert_trees_equal(got_cache, want_cache)


class _ChainOnlyFamily(DecoderOnlyFamily):
  """A family that keeps the default `supports_trees = False` (never registered)."""
  name = "chain_only"
  supports_trees = False


def test_a_family_without_trees_refuses_one_by_name():
  family = _ChainOnlyFamily()
  tree = chain_attention(1, 2)
  family.check_tree(None)  # No tree: nothing to refuse.
  with pytest.raises(ValueError, match="chain_only family does not support token trees"):
    family.check_tree(tree)
  cache = dict(layers=[dict(self_key=jnp.zeros((1, 4, 1, 2)), self_value=jnp.zeros((1, 4, 1, 2)))])
  with pytest.raises(ValueError, match="chain_only family does not support token trees"):
    family.move_cache(cache, jnp.zeros((1,), jnp.int32), jnp.zeros((1, 2), jnp.int32))
  # A callback that knows nothing of trees still serves tree-less calls through
  # the wrappers (`shift_block_fn`, `call_block`).
  seen = []
  block = shift_block_fn(lambda t, p, c: seen.append(p) or (t, c), jnp.array([3]))
  block(jnp.zeros((1, 2), jnp.int32), jnp.array([1]), None)
  assert int(seen[0][0]) == 4
