"""Medusa heads (`sj.MedusaDraft`, `drafts/medusa.py`): K heads on the target's last hidden
state, all drafted in one call, verified exactly (never "typical acceptance").

* Greedy identity against target-only decoding at the same block width, float32 and
  bfloat16, chain and static tree, on random targets of both families (vocabularies
  small enough for near-ties).
* Whole-decode chi-square at temperature 1 and at top-p against the target's exact
  law, with the test's power stated and checked.
* Public Medusa-1 directories (safetensors and .pt, written here with torch) load to the
  same arrays, and decode exactly as the draft built from those arrays.
* What a head reads: the hidden state before the row's last token (head k predicts
  the token k after it), checked against the target's own features.
* Bad input: a directory for another hidden size or vocabulary, gamma or a tree deeper
  than the heads, a malformed config.
"""

import collections
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.families.registry import family_of

from tiny_models import tiny_model




def _inputs(family, target, batch=4, width=6, seed=0):
  rng = np.random.default_rng(seed)
  vocab = target.config.vocab_size
  tokens = rng.integers(2, vocab, (batch, width)).astype(np.int32)
  if family == "t5":
    tokens[1, 3:] = 0  # ragged encoder rows
    return tokens, None
  lengths = np.array([width, 1, 4, 2][:batch], np.int32)  # a one-token prompt too
  return tokens, lengths


def _equal(a, b):
  np.testing.assert_array_equal(np.asarray(a.sequences), np.asarray(b.sequences))


@pytest.mark.parametrize("family", ["decoder_only", pytest.param("t5", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_greedy_medusa_chain_and_tree_equal_target_only(family, dtype):
  target = tiny_model(family, dtype=dtype)
  tokens, lengths = _inputs(family, target)
  medusa = sj.MedusaDraft(target, num_heads=3, num_layers=2, seed=1)
  kwargs = dict(max_decode_steps=14, eos_id=-1)
  for draft, width, extra in ((medusa, 8, dict(gamma=3)),
                              (sj.TreeDraft(medusa, (3, 2, 1)), 16, {})):
    want = sj.generate(target, tokens, lengths, block_width=width, **kwargs)
    got = sj.generate(target, tokens, lengths, draft=draft, block_width=width, **kwargs, **extra)
    _equal(got, want)
    assert got.stats.iterations.sum() > 0 and got.stats.drafted.sum() > 0
  if dtype == "bfloat16":
    # gamma='auto' (generate_many's default) times the heads alone first: in bfloat16 on
    # CPU that program raised before the heads ran batched over their leading axis.
    many = sj.generate_many(target, tokens, lengths, batch_size=2, draft=medusa,
                            block_width=8, **kwargs)
    _equal(many, sj.generate(target, tokens, lengths, block_width=8, **kwargs))
    assert "alpha" in many.slots.phases[-1]


@pytest.mark.parametrize("share_lm_head", [False, True], ids=["own_head", "shared_head"])
def test_bfloat16_heads_are_timed_at_any_batch(share_lm_head):
  """`tools.profiling.time_proposals` (what gamma='auto' times a draft by) runs the heads
  in bfloat16 at batch > 1 on CPU: XLA's CPU runtime has no kernel for a bfloat16 dot
  accumulated in float32 with its batch axis inside an operand, which the heads' matmul
  was ([batch, heads, h] against [heads, h, g]) and raised there. The logits are the
  float32 heads' to bfloat16 rounding."""
  from specdec_jax.tools import profiling
  target = tiny_model("decoder_only", dtype="bfloat16")
  tokens, lengths = _inputs("decoder_only", target, batch=3)
  medusa = sj.MedusaDraft(target, num_heads=3, num_layers=2, seed=1,
                          share_lm_head=share_lm_head)
  ms = profiling.time_proposals(target, {"medusa": medusa}, tokens, 8, 3, repeats=1, calls=2,
                                lengths=lengths)
  assert ms["medusa"] > 0
  # Against the heads written out one at a time (float32; batch 2 against 3 heads, biases
  # not zero, so a swapped axis or a head reading another's weights shows).
  wide = sj.MedusaDraft(tiny_model("decoder_only"), num_heads=3, num_layers=2, seed=1,
                        share_lm_head=share_lm_head)
  own = dict(wide.params["heads"])
  own["bias"] = 0.5 * jax.random.normal(jax.random.PRNGKey(4), own["bias"].shape)
  params = dict(wide.params, heads=own)
  hidden = jax.random.normal(jax.random.PRNGKey(3), (2, wide.hidden_dim))
  want = []
  for k in range(3):
    x = hidden
    for j in range(2):
      x = x + jax.nn.silu(x @ own["kernel"][j, k] + own["bias"][j, k])
    want.append(wide.target_logits(params["target"], x) if share_lm_head
                else x @ own["lm_head"][k])
  want = np.stack([np.asarray(w) for w in want], axis=1)  # [batch, heads, vocab]
  got = wide.head_logits(params, hidden, 3)
  assert got.shape == (2, 3, target.config.vocab_size) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
  # The bfloat16 heads (the same weights, rounded): their float32 logits to rounding.
  narrow = medusa.head_logits(dict(medusa.params, heads=jax.tree_util.tree_map(
      lambda a: a.astype(jnp.bfloat16), own)), hidden, 3)
  np.testing.assert_allclose(np.asarray(narrow), want, atol=0.1, rtol=0.05)


@pytest.mark.slow
def test_shared_lm_head_medusa_is_exact_on_both_demo_pairs():
  for name in ("t5", "decoder_only"):
    pair = sj.load_demo_pair(name)
    inputs, lengths = pair.inputs(3)
    kwargs = dict(max_decode_steps=12, block_width=8)
    want = sj.generate(pair.target, inputs, lengths, **kwargs)
    draft = sj.MedusaDraft(pair.target, num_heads=4, share_lm_head=True, seed=2)
    _equal(sj.generate(pair.target, inputs, lengths, draft=draft, gamma=4, **kwargs), want)


def _power(expected: dict, n: int):
  """(degrees of freedom after lumping cells of expected count < 5, the smallest chi-square
  effect sum((p' - p)^2 / p) detected with power 0.99 at p 1e-4)."""
  from scipy import stats as scipy_stats
  from test_speculative import P_VALUE
  big = sum(1 for v in expected.values() if v * n >= 5)
  df = big  # the lumped rest makes big + 1 cells
  critical = scipy_stats.chi2.isf(P_VALUE, df)
  effect = 1e-4
  while scipy_stats.ncx2.sf(critical, df, n * effect) < 0.99:
    effect *= 1.1
  return df, effect


@pytest.mark.slow
@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=1.0, topp=0.8)],
                         ids=["t1", "topp0.8"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_medusa_samples_follow_target_distribution(setting, tree):
  """Whole 3-token decodes over a vocabulary of 8 after a 3-token prompt, 10,000 samples,
  against the exact enumeration of the target's law (chi-square at p 1e-4).

  Power: about 270 cells of expected count >= 5 are left after lumping, so any rule
  whose output law is off by a chi-square effect sum((p' - p)^2 / p) of 0.019 or more
  (e.g. one continuation of probability 0.1 off by 0.045) is caught with probability
  >= 0.99 (noncentral chi-square, lambda = 10,000 x effect, at p 1e-4); the test
  computes that effect for its own cells and asserts it is below 0.025.
  """
  import test_trees
  from test_speculative import P_VALUE, _chi_square_ok
  n, steps = 10_000, 3
  target = sj.load_model("llama_tiny", vocab_size=8, seed=21, dtype="float32")
  prompt = np.array([3, 5, 2], np.int32)
  eos = family_of(target).eos_id(target.config)
  expected = test_trees._exact_lm_distribution(target, prompt, steps, eos, **setting)
  df, effect = _power(expected, n)
  assert effect < 0.025, (df, effect)
  medusa = sj.MedusaDraft(target, num_heads=2, seed=5)
  medusa = sj.MedusaDraft(target, num_heads=2, params=jax.tree_util.tree_map(
      lambda x: x * 40, medusa.head_params))  # sharper heads: acceptance away from 0 and 1
  draft, extra = (sj.TreeDraft(medusa, (2, 1)), dict(block_width=5)) if tree else (
      medusa, dict(gamma=2, block_width=3))
  out = sj.generate(target, np.repeat(prompt[None], n, axis=0), max_decode_steps=steps,
                    draft=draft, rng=jax.random.PRNGKey(23), **extra, **setting)
  assert 0.02 < out.stats.acceptance_rate < 0.98, out.stats.summary()
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert _chi_square_ok(observed, expected, n) > P_VALUE


def test_heads_read_the_hidden_state_before_the_last_token():
  """After the prompt, head k's law is computed from the target's feature of the
  second-to-last prompt token (the state that produced the last token's law)."""
  target = tiny_model("decoder_only", vocab=32)
  medusa = sj.MedusaDraft(target, num_heads=2, seed=4)
  tokens, lengths = _inputs("decoder_only", target)
  family = family_of(target)
  context = family.context(jnp.asarray(tokens), jnp.asarray(lengths))
  _, features, _ = family.start_features(target.config, target.params, jnp.asarray(tokens),
                                         jnp.asarray(lengths), 4, None)
  state = medusa.init_state(medusa.params, sj.DraftStart(context, 4, 4, features=features))
  np.testing.assert_array_equal(np.asarray(state["ready"]), lengths >= 2)
  # The uncached forward's last-layer features, independently.
  from specdec_jax.train.feature_heads import target_features
  full = np.asarray(target_features(target, tokens))
  for b in np.flatnonzero(lengths >= 2):
    np.testing.assert_allclose(np.asarray(state["hidden"][b]), full[b, lengths[b] - 2],
                               rtol=1e-5, atol=1e-5)
  logits = np.asarray(medusa.head_logits(medusa.params, state["hidden"], 2))
  assert logits.shape == (len(tokens), 2, 32) and np.std(logits) > 0


# ---------------------------------------------------------------------------
# Public Medusa-1 directories.

def _write_public(directory, draft, file_format):
  """Medusa's own layout, written with torch: {i}.{j}.linear.{weight,bias}, {i}.{L}.weight."""
  torch = pytest.importorskip("torch")
  params = {k: np.asarray(v, np.float32) for k, v in draft.head_params.items()}
  state = {}
  for i in range(draft.num_heads):
    for j in range(draft.num_layers):
      state[f"{i}.{j}.linear.weight"] = torch.tensor(params["kernel"][j, i].T.copy())
      state[f"{i}.{j}.linear.bias"] = torch.tensor(params["bias"][j, i].copy())
    state[f"{i}.{draft.num_layers}.weight"] = torch.tensor(params["lm_head"][i].T.copy())
  os.makedirs(directory, exist_ok=True)
  if file_format == "pt":
    torch.save(state, os.path.join(directory, "medusa_lm_head.pt"))
  else:
    from safetensors.torch import save_file
    save_file(state, os.path.join(directory, "medusa_lm_head.safetensors"))
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump({"medusa_num_heads": draft.num_heads, "medusa_num_layers": draft.num_layers,
               "base_model_name_or_path": "local"}, f)
  return state


@pytest.mark.parametrize("file_format", ["safetensors", pytest.param("pt", marks=pytest.mark.slow)])
def test_public_medusa_directory_loads_and_decodes_as_the_same_arrays(tmp_path, file_format):
  target = tiny_model("decoder_only", vocab=32)
  built = sj.MedusaDraft(target, num_heads=3, num_layers=2, seed=7)
  built = sj.MedusaDraft(target, num_heads=3, num_layers=2, params=dict(
      built.head_params, bias=0.1 * jnp.ones_like(built.head_params["bias"])))
  _write_public(tmp_path / "m", built, file_format)
  loaded = sj.load_medusa_draft(tmp_path / "m", target)
  assert (loaded.num_heads, loaded.num_layers) == (3, 2)
  for name in ("kernel", "bias", "lm_head"):
    np.testing.assert_array_equal(np.asarray(loaded.head_params[name]),
                                  np.asarray(built.head_params[name]), err_msg=name)
  tokens, lengths = _inputs("decoder_only", target)
  kwargs = dict(max_decode_steps=10, temperature=1.0, rng=jax.random.PRNGKey(3), gamma=3)
  _equal(sj.generate(target, tokens, lengths, draft=loaded, **kwargs),
         sj.generate(target, tokens, lengths, draft=built, **kwargs))
  # Our writer's directory reads back the same.
  sj.save_medusa_draft(loaded, tmp_path / "again")
  again = sj.load_medusa_draft(tmp_path / "again", target)
  for name in ("kernel", "bias", "lm_head"):
    np.testing.assert_array_equal(np.asarray(again.head_params[name]),
                                  np.asarray(built.head_params[name]), err_msg=name)


def test_bad_medusa_input_gets_clear_errors(tmp_path):
  target = tiny_model("decoder_only", vocab=32)
  other = sj.load_model("llama_tiny", vocab_size=32, seed=0, emb_dim=48, num_heads=3,
                        num_kv_heads=1)
  _write_public(tmp_path / "hidden", sj.MedusaDraft(other, num_heads=2, seed=1), "safetensors")
  with pytest.raises(sj.CheckpointError, match=r"hidden size 64, vocabulary 32\):\n  shape "
                                               r"mismatch \(6\):[\s\S]*medusa_lm_head."
                                               r"safetensors: 0.0.linear.bias: \(48,\) vs "
                                               r"expected \(64,\)"):
    sj.load_medusa_draft(tmp_path / "hidden", target)
  small_vocab = sj.load_model("llama_tiny", vocab_size=24, seed=0)
  _write_public(tmp_path / "vocab", sj.MedusaDraft(small_vocab, num_heads=2, seed=1), "pt")
  with pytest.raises(sj.CheckpointError, match=r"medusa_lm_head.pt: 0.1.weight: \(24, 64\) vs "
                                               r"expected \(32, 64\)"):
    sj.load_medusa_draft(tmp_path / "vocab", target)
  os.makedirs(tmp_path / "noconfig")
  with pytest.raises(sj.CheckpointError, match="not a Medusa head directory"):
    sj.load_medusa_draft(tmp_path / "noconfig", target)
  _write_public(tmp_path / "badcfg", sj.MedusaDraft(target, num_heads=2, seed=1), "pt")
  with open(tmp_path / "badcfg" / "config.json", "w") as f:
    json.dump({"medusa_num_layers": 1}, f)
  with pytest.raises(sj.CheckpointError, match="medusa_num_heads must be an int >= 1"):
    sj.load_medusa_draft(tmp_path / "badcfg", target)
  medusa = sj.MedusaDraft(target, num_heads=2, seed=1)
  tokens, lengths = _inputs("decoder_only", target)
  with pytest.raises(ValueError, match="gamma=3 drafts 3 tokens .* this MedusaDraft has 2 heads"):
    sj.generate(target, tokens, lengths, draft=medusa, gamma=3, max_decode_steps=4)
  with pytest.raises(ValueError, match="a tree of depth 3 needs a head per level; this "
                                       "MedusaDraft has 2"):
    sj.TreeDraft(medusa, (2, 2, 1))
  with pytest.raises(ValueError, match="a tree of depth 3 needs a head per level"):
    sj.DynamicTreeDraft(medusa, topk=2, depth=3)
  with pytest.raises(ValueError, match="num_heads must be an int >= 1"):
    sj.MedusaDraft(target, num_heads=0)
  with pytest.raises(ValueError, match="share_lm_head=False"):
    sj.save_medusa_draft(sj.MedusaDraft(target, num_heads=2, share_lm_head=True), tmp_path / "s")
  with pytest.raises(ValueError, match="built for another target config"):
    sj.generate(other, tokens, lengths, draft=medusa, gamma=2, max_decode_steps=4)
  # A family that keeps its hidden states to itself cannot serve the heads.
  import test_families  # registers its toy family
  toy = sj.load_model("toy_small", seed=1)
  with pytest.raises(ValueError, match=r"the toy family does not expose its hidden states .* "
                                       r"\(FeatureDraft, MedusaDraft\) cannot serve it"):
    sj.MedusaDraft(toy)
  assert test_families.TOY is family_of(toy)


def test_tree_levels_come_from_head_depth_plus_one_whatever_the_pending_chain():
  """The tree's root is the chain's end and h the state before it (`observe` hands over the
  whole accepted path, pending tokens included): the root's children come from head 1 and a
  node at depth d's from head d + 1, for every chain length."""
  from specdec_jax.core import sampling
  from specdec_jax.core.token_tree import TreeAttention
  target = tiny_model("decoder_only", vocab=32)
  medusa = sj.MedusaDraft(target, num_heads=3, seed=6)
  expander = medusa.tree_expander(medusa.params, sj.Sampling(1.0))
  hidden = jax.random.normal(jax.random.PRNGKey(0), (2, medusa.hidden_dim))
  state = expander.init(dict(hidden=hidden, ready=jnp.array([True, True])), 2, 8)
  laws = np.asarray(sampling.adjust_probs(medusa.head_logits(medusa.params, hidden, 3)))
  chain_len = jnp.array([2, 0], jnp.int32)  # a row with two pending tokens, a row with none
  rows = jnp.zeros((2, 6), jnp.int32)
  _, root_probs, state = expander.start(state, rows, jnp.array([3, 3], jnp.int32),
                                        jnp.zeros((2, 2), jnp.int32), chain_len)
  np.testing.assert_allclose(np.asarray(root_probs), laws[:, 0], rtol=1e-6, atol=1e-7)
  depths = jnp.array([[1, 2, 2], [2, 1, 1]], jnp.int32)
  attention = TreeAttention(jnp.zeros((2,), jnp.int32), depths, jnp.ones((2, 3, 3), bool),
                            jnp.zeros((2, 3), jnp.int32))
  _, probs, _ = expander.expand(state, None, chain_len, None, attention, 1)
  for b in range(2):
    for i, d in enumerate(np.asarray(depths[b])):
      np.testing.assert_allclose(np.asarray(probs[b, i]), laws[b, d], rtol=1e-6, atol=1e-7)
  assert not np.allclose(laws[:, 0], laws[:, 1])  # the heads differ: a real check


def test_medusa_loss_pairs_head_k_at_t_with_the_targets_law_at_t_plus_k():
  """The Medusa-1 loss against a reference written out position by position: head k at
  position t, the target's law of token t + 1 + k (its logits at t + k), weights w_t w_{t+k},
  head k weighted decay**(k-1)."""
  from specdec_jax.train.feature_heads import feature_batch
  from specdec_jax.train.medusa import medusa_loss_fn
  target = tiny_model("decoder_only", vocab=32)
  medusa = sj.MedusaDraft(target, num_heads=3, seed=2)
  tokens = np.random.default_rng(1).integers(2, 32, (2, 7)).astype(np.int32)
  weights = np.ones_like(tokens, np.float32)
  weights[1, 5:] = 0
  batch = feature_batch(target, dict(tokens=tokens, weights=weights))
  loss, aux = medusa_loss_fn(medusa, decay=0.5)(medusa.head_params, batch)
  features = np.asarray(batch["features"])
  heads = np.asarray(medusa.head_logits(medusa.params, jnp.asarray(features.reshape(14, -1)),
                                        3)).reshape(2, 7, 3, -1)
  teacher = np.asarray(medusa.target_logits(medusa.projection_refs, jnp.asarray(features)))

  def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))

  want = 0.0
  for k in (1, 2, 3):
    for b in range(2):
      for t in range(7 - k):
        p = np.exp(log_softmax(teacher[b, t + k]))
        ce = -np.sum(p * log_softmax(heads[b, t, k - 1]))
        want += 0.5 ** (k - 1) * weights[b, t] * weights[b, t + k] * ce
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  assert float(aux["positions_2"]) == 5 + 3  # row 0: t = 0..4; row 1: t = 0..2
