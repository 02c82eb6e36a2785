"""DFlash drafters (`sj.DFlashDraft`, `drafts/dflash.py`): a block of masks filled in one
non-causal call over the target's features, both families.

* The context cache: laws computed incrementally, observe after observe with
  garbage in the feature slots past each accepted count (what a rejected draft's
  features would be), equal laws computed from scratch over the accepted sequence
  alone: the target's features at rejected positions never reach the drafter.
* Greedy identity against target-only decoding, chain and tree, both families, float32
  and bfloat16.
* Whole-decode chi-square at temperature 1, top-k and top-p, chain and tree.
* Bad input: a wrong hidden size, a mask id outside the vocabulary, gamma past the block.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.families.registry import family_of

from tiny_models import tiny_model




def _inputs(family, vocab, batch=3, width=5, seed=0):
  tokens = np.random.default_rng(seed).integers(2, vocab, (batch, width)).astype(np.int32)
  if family == "t5":
    tokens[1, 2:] = 0
    return tokens, None
  return tokens, np.array([5, 1, 3][:batch], np.int32)


def _sharp(draft, scale=30.0):
  """The same drafter with its fc scaled: sharper laws, acceptance away from 0 and 1."""
  params = jax.tree_util.tree_map(lambda x: x, draft.head_params)
  params["fc"]["kernel"] = params["fc"]["kernel"] * scale
  return params


@pytest.mark.parametrize("family", ["decoder_only", pytest.param("t5", marks=pytest.mark.slow)])
def test_laws_from_the_incremental_context_equal_laws_from_scratch(family):
  """Rows gain 1..K+1 tokens per iteration; `observe` gets the target's features at the
  whole block, the slots past the accepted count filled with garbage (a rejected draft's
  features). The laws then equal those of a fresh state built from the accepted tokens'
  features alone (decoder-only: the whole accepted sequence as the prompt; T5: one observe
  of every accepted position)."""
  vocab, k = 16, 3
  target = tiny_model(family, vocab)
  draft = sj.DFlashDraft(target, block_size=k + 1, num_layers=2, seed=4)
  fam = family_of(target)
  params = draft.params
  batch = 2
  tokens, lengths = _inputs(family, vocab, batch=batch)
  story = np.random.default_rng(3).integers(2, vocab, (batch, 30)).astype(np.int32)
  if family == "t5":
    story[:, 0] = target.config.decoder_start_id
    full = story
  else:
    story[:, 0] = tokens[np.arange(batch), lengths - 1]
    full = [np.concatenate([tokens[b, :lengths[b] - 1], story[b]]) for b in range(batch)]
  # The target's features at every position of each row's full sequence.
  feature_fn = fam.feature_block_fn(target.config, target.params, draft.config.taps)
  start, prompt_features, memory = fam.start_features(
      target.config, target.params, jnp.asarray(tokens),
      jnp.asarray(lengths if lengths is not None else np.full(batch, 5, np.int32)), 40,
      draft.config.taps)
  if family == "t5":
    _, features, _ = feature_fn(jnp.asarray(story), start.offset, start.cache)
  else:
    width = max(len(f) for f in full)
    padded = np.stack([np.pad(f, (0, width - len(f))) for f in full]).astype(np.int32)
    features = jnp.stack([target_features(fam, target, padded[b:b + 1], draft.config.taps)[0]
                          for b in range(batch)])
  context = sj.Context(jnp.asarray(tokens), jnp.asarray(
      lengths if lengths is not None else np.sum(tokens != 0, 1).astype(np.int32)),
      continued=family != "t5")
  state = draft.init_state(params, sj.DraftStart(context, 40, k, prompt_features, memory))
  observe = draft.observer(params)
  offset = np.asarray(state["offset"])
  done = np.zeros(batch, np.int32)  # loop position of each row's last token
  garbage = jax.random.normal(jax.random.PRNGKey(9), (batch, k + 1, draft.feature_dim)) * 50
  for gains in ([1, 4], [4, 2], [3, 1], [2, 3]):
    count = jnp.asarray(gains, jnp.int32)
    at = (offset + done)[:, None] + np.arange(k + 1)[None]
    block = features[np.arange(batch)[:, None], np.minimum(at, features.shape[1] - 1)]
    block = jnp.where(jnp.arange(k + 1)[None, :, None] < count[:, None, None], block, garbage)
    state = observe(state, block, None, count)
    done = done + np.asarray(gains)
    got, _, _ = draft.block_laws(params, state, jnp.asarray(story), jnp.asarray(done), k, k + 1)
    # From scratch: the accepted sequence as the context.
    for b in range(batch):
      end = int(offset[b] + done[b])  # the row's last token's absolute position
      if family == "t5":
        fresh = draft.init_state(params, sj.DraftStart(
            sj.Context(jnp.asarray(tokens[b:b + 1]), context.lengths[b:b + 1]), 40, k, None,
            jax.tree_util.tree_map(lambda x: x[b:b + 1], memory)))
        fresh = observe(fresh, features[b:b + 1, :end], None, jnp.asarray([end]))
      else:
        prompt = jnp.asarray(full[b][:end + 1][None])
        fresh = draft.init_state(params, sj.DraftStart(
            sj.Context(prompt, jnp.asarray([end + 1]), continued=True), 40, k,
            features[b:b + 1, :end + 1], None))
      want, _, _ = draft.block_laws(params, fresh, jnp.asarray(story[b:b + 1]),
                                    jnp.asarray(done[b:b + 1]), k, k + 1)
      np.testing.assert_allclose(np.asarray(got[b]), np.asarray(want[0]), rtol=2e-4, atol=2e-4)


def target_features(fam, target, tokens, taps):
  """The decoder-only target's features at every position of tokens [1, n] (one block)."""
  start, features, _ = fam.start_features(target.config, target.params, jnp.asarray(tokens),
                                          jnp.asarray([tokens.shape[1]]), 4, taps)
  return features


@pytest.mark.parametrize("family", ["decoder_only", pytest.param("t5", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_greedy_dflash_chain_and_tree_equal_target_only(family, dtype):
  vocab = 16
  target = tiny_model(family, vocab, dtype=dtype)
  tokens, lengths = _inputs(family, vocab)
  draft = sj.DFlashDraft(target, block_size=4, seed=1)
  draft = sj.DFlashDraft(target, block_size=4, params=_sharp(draft))
  kwargs = dict(max_decode_steps=14, eos_id=-1)
  for use, width, extra in ((draft, 4, dict(gamma=3)), (draft, 8, dict(gamma=2)),
                            (sj.TreeDraft(draft, (3, 2, 1)), 16, {})):
    want = sj.generate(target, tokens, lengths, block_width=width, **kwargs)
    got = sj.generate(target, tokens, lengths, draft=use, block_width=width, **kwargs, **extra)
    np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
    assert got.stats.drafted.sum() > 0


@pytest.mark.slow
@pytest.mark.parametrize("setting", [dict(temperature=1.0), dict(temperature=1.0, topp=0.8),
                                     dict(temperature=1.0, topk=3)],
                         ids=["t1", "topp0.8", "topk3"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_dflash_samples_follow_target_distribution(setting, tree):
  """Whole 3-token decodes over a vocabulary of 8 after a 3-token prompt, 10,000 samples,
  against the exact enumeration of the target's law (chi-square at p 1e-4), with the
  smallest effect detected at power 0.99 asserted below 0.025 (`test_medusa._power`)."""
  import test_trees
  from test_medusa import _power
  from test_speculative import P_VALUE, _chi_square_ok
  n, steps = 10_000, 3
  target = sj.load_model("llama_tiny", vocab_size=8, seed=21, dtype="float32")
  prompt = np.array([3, 5, 2], np.int32)
  eos = family_of(target).eos_id(target.config)
  expected = test_trees._exact_lm_distribution(target, prompt, steps, eos, **setting)
  df, effect = _power(expected, n)
  assert effect < 0.025, (df, effect)
  draft = sj.DFlashDraft(target, block_size=3, seed=5)
  draft = sj.DFlashDraft(target, block_size=3, params=_sharp(draft, 60.0))
  use, extra = (sj.TreeDraft(draft, (2, 1)), dict(block_width=5)) if tree else (
      draft, dict(gamma=2, block_width=3))
  out = sj.generate(target, np.repeat(prompt[None], n, axis=0), max_decode_steps=steps,
                    draft=use, rng=jax.random.PRNGKey(23), **extra, **setting)
  assert 0.02 < out.stats.acceptance_rate < 0.98, out.stats.summary()
  observed = collections.Counter(map(tuple, np.asarray(out.sequences).tolist()))
  assert _chi_square_ok(observed, expected, n) > P_VALUE


def test_bad_dflash_input_gets_clear_errors():
  target = tiny_model("decoder_only", 16)
  with pytest.raises(ValueError, match="block_size must be an int >= 2"):
    sj.DFlashDraft(target, block_size=1)
  with pytest.raises(ValueError, match=r"mask_token_id 16 is not an id of the target's "
                                       r"vocabulary \[0, 16\)"):
    sj.DFlashDraft(target, mask_token_id=16)
  with pytest.raises(ValueError, match="feature layers"):
    sj.DFlashDraft(target, feature_layers=(7,))
  draft = sj.DFlashDraft(target, block_size=3)
  with pytest.raises(ValueError, match="gamma=3 asks one call of this DFlashDraft for 3 laws"):
    sj.generate(target, np.ones((1, 3), np.int32), draft=draft, gamma=3, max_decode_steps=4)
  other = tiny_model("decoder_only", 16, seed=9)
  other = family_of(other).model_type(other.config.replace(emb_dim=64, head_dim=32),
                                      other.params)
  with pytest.raises(ValueError, match="built for another target config"):
    draft.check_compatible(other.config)
  with pytest.raises(ValueError, match=r"DFlash params do not match .* missing \['norm'\]"):
    params = dict(draft.head_params)
    params.pop("norm")
    sj.DFlashDraft(target, block_size=3, params=params)


# -- z-lab directories ----------------------------------------------------------------------


def _reference_laws(draft, target, prompt, k):
  """DFlash's forward written out in numpy from z-lab's public model code's description
  (an independent reference): after a decoder-only prompt, the laws at the K mask slots."""
  c, own = draft.config, jax.tree_util.tree_map(np.asarray, draft.head_params)
  fam = family_of(target)
  _, features, _ = fam.start_features(target.config, target.params, jnp.asarray(prompt[None]),
                                      jnp.asarray([len(prompt)]), 4, c.taps)
  f = np.asarray(features[0, :len(prompt) - 1], np.float64)  # context: all but the last token

  def rms(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c.rms_eps) * w

  def rope(x, pos):  # x [n, heads, d]
    d = x.shape[-1]
    inv = 1.0 / (c.rope_theta ** (np.arange(0, d, 2) / d))
    ang = np.asarray(pos)[:, None] * inv
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    half = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos[:, None] + half * sin[:, None]

  table = np.asarray(target.params["embed_tokens"]["embedding"], np.float64)
  ctx = rms(f @ own["fc"]["kernel"], own["hidden_norm"])
  n_ctx = len(prompt) - 1
  block = np.array([prompt[-1]] + [c.mask_token_id] * k)
  x = table[block] * c.input_scale
  pos_ctx, pos_blk = np.arange(n_ctx), n_ctx + np.arange(k + 1)
  for i in range(c.num_layers):
    layer = own["layers"][str(i)]
    a = layer["self_attn"]
    y = rms(x, layer["input_layernorm"])
    q = rope(rms((y @ a["q_proj"]["kernel"]).reshape(k + 1, c.num_heads, c.head_dim),
                 a["q_norm"]), pos_blk)
    both = np.concatenate([ctx, y])
    keys = rope(rms((both @ a["k_proj"]["kernel"]).reshape(-1, c.num_kv_heads, c.head_dim),
                    a["k_norm"]), np.concatenate([pos_ctx, pos_blk]))
    vals = (both @ a["v_proj"]["kernel"]).reshape(-1, c.num_kv_heads, c.head_dim)
    group = c.num_heads // c.num_kv_heads
    keys, vals = np.repeat(keys, group, 1), np.repeat(vals, group, 1)
    scores = np.einsum("qhd,khd->hqk", q, keys) / np.sqrt(c.head_dim)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", w, vals).reshape(k + 1, -1)
    x = x + out @ a["o_proj"]["kernel"]
    y = rms(x, layer["post_attention_layernorm"])
    m = layer["mlp"]
    g = y @ m["gate_proj"]["kernel"]
    x = x + ((g / (1 + np.exp(-g))) * (y @ m["up_proj"]["kernel"])) @ m["down_proj"]["kernel"]
  hidden = rms(x, own["norm"])[1:]
  head = table if target.config.tie_word_embeddings else np.asarray(
      target.params["lm_head"]["kernel"], np.float64).T
  return hidden @ head.T * c.output_multiplier


def test_zlab_directory_loads_to_the_same_drafter_and_matches_a_reference(tmp_path):
  """save_dflash_draft writes z-lab's layout (target_layer_ids = taps - 1, [out, in]
  weights); load_dflash_draft reads it back to the same arrays, which sample the same
  tokens; and the laws equal an independent numpy forward of DFlash's published model."""
  import json
  target = sj.load_model("qwen3_tiny", vocab_size=40, seed=2)
  draft = sj.DFlashDraft(target, block_size=4, num_layers=2, num_kv_heads=2, head_dim=16,
                         intermediate=96, feature_layers=(1, 2), mask_token_id=39, seed=8)
  draft = sj.DFlashDraft(target, config=draft.config, params=_sharp(draft, 20.0))
  sj.save_dflash_draft(draft, tmp_path / "d")
  hf = json.loads((tmp_path / "d" / "config.json").read_text())
  assert hf["dflash_config"]["target_layer_ids"] == [0, 1] and hf["hidden_size"] == 64
  loaded = sj.load_dflash_draft(tmp_path / "d", target)
  assert loaded.config == draft.config
  for a, b in zip(jax.tree_util.tree_leaves(loaded.head_params),
                  jax.tree_util.tree_leaves(draft.head_params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  tokens, lengths = np.array([[5, 9, 3, 7, 11], [4, 2, 0, 0, 0]], np.int32), np.array([5, 2])
  kwargs = dict(gamma=3, max_decode_steps=10, eos_id=-1, temperature=1.0,
                rng=jax.random.PRNGKey(3))
  np.testing.assert_array_equal(
      np.asarray(sj.generate(target, tokens, lengths, draft=loaded, **kwargs).sequences),
      np.asarray(sj.generate(target, tokens, lengths, draft=draft, **kwargs).sequences))
  prompt = np.array([5, 9, 3, 7, 11], np.int32)
  context = sj.Context(jnp.asarray(prompt[None]), jnp.asarray([5]), continued=True)
  fam = family_of(target)
  _, features, _ = fam.start_features(target.config, target.params, context.tokens,
                                      context.lengths, 8, draft.config.taps)
  state = loaded.init_state(loaded.params, sj.DraftStart(context, 8, 3, features, None))
  got, _, _ = loaded.block_laws(loaded.params, state, jnp.asarray(prompt[-1:][None]),
                                jnp.asarray([0]), 3, 4)
  np.testing.assert_allclose(np.asarray(got[0]), _reference_laws(loaded, target, prompt, 3),
                             rtol=1e-4, atol=1e-4)


def test_bad_dflash_directories_get_clear_errors(tmp_path):
  import json
  target = sj.load_model("qwen3_tiny", vocab_size=40, seed=2)
  draft = sj.DFlashDraft(target, block_size=3, feature_layers=(1, 2), seed=1)
  sj.save_dflash_draft(draft, tmp_path / "d")
  config_path = tmp_path / "d" / "config.json"
  good = json.loads(config_path.read_text())

  def with_config(**changes):
    config_path.write_text(json.dumps({**good, **changes}))

  with_config(architectures=["DFlash2DraftModel"])
  with pytest.raises(sj.CheckpointError, match="DFlash-2 drafter"):
    sj.load_dflash_draft(tmp_path / "d", target)
  with_config(hidden_size=32)
  with pytest.raises(sj.CheckpointError, match="hidden_size 32 differs from the target's 64"):
    sj.load_dflash_draft(tmp_path / "d", target)
  with_config(dflash_config={**good["dflash_config"], "target_layer_ids": [0, 5]})
  with pytest.raises(sj.CheckpointError, match=r"target_layer_ids \[0, 5\] fall outside"):
    sj.load_dflash_draft(tmp_path / "d", target)
  with_config(layer_types=["sliding_attention"])
  with pytest.raises(sj.CheckpointError, match="sliding-window layers are not read"):
    sj.load_dflash_draft(tmp_path / "d", target)
  with_config(dflash_config={})
  with pytest.raises(sj.CheckpointError, match="no dflash_config.target_layer_ids"):
    sj.load_dflash_draft(tmp_path / "d", target)
  with_config(num_hidden_layers=2)
  with pytest.raises(sj.CheckpointError, match=r"missing \(\d+\):\n    layers.1"):
    sj.load_dflash_draft(tmp_path / "d", target)
  with pytest.raises(sj.CheckpointError, match="no registered dflash-head format serves the t5 family"):
    sj.load_dflash_draft(tmp_path / "d", sj.load_model("tiny", vocab_size=40))
  with pytest.raises(sj.CheckpointError, match="no such directory"):
    sj.load_dflash_draft(tmp_path / "nowhere", target)


@pytest.mark.parametrize("family", ["decoder_only", pytest.param("t5", marks=pytest.mark.slow)])
def test_grown_drafter_drives_the_embedded_target_to_the_same_laws(family):
  """`sj.scale_pair`'s rule for DFlash: a drafter grown with its target (stream r times
  wider, r times the heads and MLP units, zeros where new) gives the same laws over the
  embedded target's features, and the same greedy decode."""
  from specdec_jax.scaled_pair import embed_draft
  vocab = 16
  small = tiny_model(family, vocab)
  config = small.config
  if family == "t5":
    large_config = config.replace(emb_dim=2 * config.emb_dim,
                                  num_decoder_layers=config.num_decoder_layers + 1,
                                  num_encoder_layers=config.num_encoder_layers + 1)
  else:
    large_config = config.replace(emb_dim=2 * config.emb_dim, num_layers=config.num_layers + 1)
  large = sj.embed_model(small, large_config)
  taps = (1, _depth(small))
  draft = sj.DFlashDraft(small, block_size=4, num_layers=2, feature_layers=taps, seed=6)
  draft = sj.DFlashDraft(small, config=draft.config, params=_sharp(draft, 20.0))
  grown = embed_draft(draft, small, large)
  assert grown.config.taps == (taps[0], _depth(large))
  tokens, lengths = _inputs(family, vocab)
  kwargs = dict(gamma=3, max_decode_steps=10, eos_id=-1, block_width=4)
  a = sj.generate(small, tokens, lengths, draft=draft, **kwargs)
  b = sj.generate(large, tokens, lengths, draft=grown, **kwargs)
  np.testing.assert_array_equal(np.asarray(a.sequences), np.asarray(b.sequences))
  np.testing.assert_array_equal(a.stats.position_accepted, b.stats.position_accepted)
  # The laws themselves, at the decode's start.
  laws = []
  for model, use in ((small, draft), (large, grown)):
    fam = family_of(model)
    lens = jnp.asarray(lengths if lengths is not None else np.sum(tokens != 0, 1), jnp.int32)
    _, features, memory = fam.start_features(model.config, model.params, jnp.asarray(tokens),
                                             lens, 12, use.config.taps)
    context = sj.Context(jnp.asarray(tokens), lens, continued=family != "t5")
    state = use.init_state(use.params, sj.DraftStart(context, 12, 3, features, memory))
    first = jnp.asarray(tokens[np.arange(len(tokens)), np.asarray(lens) - 1][:, None]
                        if family != "t5" else np.zeros((len(tokens), 1), np.int32))
    laws.append(use.block_laws(use.params, state, first, jnp.zeros(len(tokens), jnp.int32),
                               3, 4)[0])
  np.testing.assert_allclose(np.asarray(laws[0]), np.asarray(laws[1]), rtol=1e-4, atol=1e-4)


def _depth(model):
  return getattr(model.config, "num_layers", None) or model.config.num_decoder_layers
