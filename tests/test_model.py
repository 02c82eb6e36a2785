"""The T5 network: T5X parameter tree, cached block decoding == uncached forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

import specdec_jax as sj
from specdec_jax.tools import testing


def _tree_shapes(name):
  cfg = sj.get_config(name)
  module = sj.Model(cfg, None).module
  dummy = jnp.ones((1, 1), jnp.int32)
  shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), dummy, dummy))
  return {k: v.shape for k, v in flatten_dict(shapes["params"], sep="/").items()}


def _expected_t5x_tree(emb, heads, head_dim, layers, mlp, gated, vocab=32128):
  inner = heads * head_dim
  wi = ["wi_0", "wi_1"] if gated else ["wi"]
  tree = {"token_embedder/embedding": (vocab, emb),
          "encoder/relpos_bias/rel_embedding": (heads, 32),
          "decoder/relpos_bias/rel_embedding": (heads, 32),
          "encoder/encoder_norm/scale": (emb,), "decoder/decoder_norm/scale": (emb,)}
  if gated:
    tree["decoder/logits_dense/kernel"] = (emb, vocab)
  for i in range(layers):
    enc = f"encoder/layers_{i}/"
    dec = f"decoder/layers_{i}/"
    for norm in ("pre_attention_layer_norm", "pre_mlp_layer_norm"):
      tree[enc + norm + "/scale"] = (emb,)
    for norm in ("pre_self_attention_layer_norm", "pre_cross_attention_layer_norm",
                 "pre_mlp_layer_norm"):
      tree[dec + norm + "/scale"] = (emb,)
    for prefix, attn in ((enc, "attention"), (dec, "self_attention"),
                         (dec, "encoder_decoder_attention")):
      for proj in ("query", "key", "value"):
        tree[f"{prefix}{attn}/{proj}/kernel"] = (emb, inner)
      tree[f"{prefix}{attn}/out/kernel"] = (inner, emb)
    for prefix in (enc, dec):
      for name in wi:
        tree[f"{prefix}mlp/{name}/kernel"] = (emb, mlp)
      tree[f"{prefix}mlp/wo/kernel"] = (mlp, emb)
  return tree


def test_param_tree_matches_t5x_t5_1_1_small():
  assert _tree_shapes("t5_1_1_small") == _expected_t5x_tree(512, 6, 64, 8, 1024, gated=True)


def test_param_tree_matches_t5x_original_t5_small():
  assert _tree_shapes("t5_small") == _expected_t5x_tree(512, 8, 64, 6, 2048, gated=False)


@pytest.mark.parametrize("name", sorted(sj.CONFIGS))
def test_every_named_config_builds_shapes(name):
  shapes = _tree_shapes(name)
  assert sum(int(np.prod(s)) for s in shapes.values()) == sj.get_config(name).num_params


def test_unknown_config_lists_known_ones():
  with pytest.raises(ValueError, match="t5_1_1_small") as err:
    sj.load_model("t5_1_1_huge")
  assert "t5_1_1_huge" in str(err.value)


def test_config_overrides_and_bad_fields():
  model = sj.load_model("t5_1_1_small", num_encoder_layers=1, num_decoder_layers=1,
                        vocab_size=64, emb_dim=32, mlp_dim=48, num_heads=3, head_dim=8)
  assert model.params["token_embedder"]["embedding"].shape == (64, 32)
  with pytest.raises(ValueError, match="no_such_field"):
    sj.load_model("tiny", no_such_field=3)
  with pytest.raises(ValueError, match="num_heads"):
    sj.T5Config(num_heads=0)


def _variant_models():
  gated = sj.load_model("tiny", vocab_size=61, num_heads=3, head_dim=8,
                        num_encoder_layers=2, num_decoder_layers=3)
  relu_tied = sj.load_model("tiny", vocab_size=61, mlp_activations=("relu",),
                            logits_via_embedding=True, num_heads=5, head_dim=4)
  return {"t5_1_1": gated, "original_t5": relu_tied}


@pytest.mark.parametrize("variant", ["t5_1_1", pytest.param("original_t5", marks=pytest.mark.slow)])
def test_cached_blocks_equal_uncached_forward(variant):
  """Random block sizes, rows at different positions, and rollbacks."""
  model = _variant_models()[variant]
  batch, length = 3, 14
  rng = np.random.RandomState(0)
  enc = testing.random_encoder_tokens(batch, 9, 61, seed=1)
  targets = rng.randint(2, 61, (batch, length)).astype(np.int32)
  dec_inputs = np.concatenate([np.zeros((batch, 1), np.int32), targets[:, :-1]], axis=1)
  full = np.asarray(model.logits(enc, dec_inputs))

  cache = model.init_cache(batch, length + 8, enc)
  positions = np.zeros(batch, np.int32)
  got = np.full(full.shape, np.nan, np.float32)
  while positions.min() < length:
    k = rng.randint(1, 5)
    # Each row keeps only the first `advance` of the k scored tokens: the
    # rest is a rejected draft whose cache entries must not matter.
    advance = rng.randint(1, k + 1, batch)
    padded = np.pad(dec_inputs, ((0, 0), (0, 8)))
    block = np.stack([padded[b, positions[b]:positions[b] + k] for b in range(batch)])
    wrong = rng.randint(2, 61, block.shape)  # rejected drafts get junk tokens
    block = np.where(np.arange(k)[None] < advance[:, None], block, wrong).astype(np.int32)
    logits, cache = model.decode_block(block, positions, cache)
    for b in range(batch):
      for j in range(advance[b]):
        if positions[b] + j < length:
          got[b, positions[b] + j] = logits[b, j]
    positions = positions + advance
  np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-5 * np.abs(full).max())


def _greedy_reference(model, enc, steps, eos_id):
  """Step-by-step argmax over the uncached forward pass."""
  batch = enc.shape[0]
  # Fixed length (one compile): causality makes logits at t ignore later slots.
  dec = np.zeros((batch, steps), np.int32)
  done = np.zeros(batch, bool)
  out = np.zeros((batch, steps), np.int32)
  for t in range(steps):
    logits = np.asarray(model.logits(enc, dec))[:, t]
    token = np.where(done, 0, logits.argmax(-1))
    out[:, t] = token
    done |= token == eos_id
    if t + 1 < steps:
      dec[:, t + 1] = token
  return out


def test_greedy_generate_equals_stepwise_argmax():
  model = sj.load_model("tiny", vocab_size=64, seed=3)
  enc = testing.random_encoder_tokens(5, 8, 64, seed=4)
  steps = 12
  out = sj.generate(model, enc, max_decode_steps=steps)
  # Choose an EOS that some rows emit mid-way, so early stopping is exercised.
  eos = testing.eos_splitting_rows(out.sequences)
  out = sj.generate(model, enc, max_decode_steps=steps, eos_id=eos)
  ref = _greedy_reference(model, enc, steps, eos)
  np.testing.assert_array_equal(np.asarray(out.sequences), ref)
  assert any(len(set(row[:6])) >= 3 for row in ref.tolist()), "degenerate outputs prove nothing"
  lengths = np.asarray(out.lengths)
  assert (lengths < steps).any()
  for row, n in zip(ref, lengths):
    assert (row[n:] == 0).all()


def test_temperature_sample_t5x_semantics():
  """Forced decoder prompt, num_decodes, and log-prob ordering."""
  model = sj.load_model("tiny", vocab_size=32, seed=5)
  enc = testing.random_encoder_tokens(2, 6, 32, seed=6)
  length = 8
  cache = model.init_cache(2, length, enc)
  inputs = np.zeros((2, length), np.int32)
  inputs[:, 1:3] = [[7, 9], [11, 13]]  # a two-token prompt after BOS
  fn = sj.core.decoding.block_to_state_fn(model.block_fn())
  decodes, log_prob = jax.jit(
      lambda i, c, r: sj.temperature_sample(i, c, fn, eos_id=1, decode_rng=r, num_decodes=3,
                                            temperature=1.0, topk=0))(
                                                inputs, cache, jax.random.PRNGKey(0))
  assert decodes.shape == (2, 3, length) and log_prob.shape == (2, 3)
  np.testing.assert_array_equal(np.asarray(decodes)[:, :, :2],
                                np.broadcast_to([[[7, 9]], [[11, 13]]], (2, 3, 2)))
  assert (np.diff(np.asarray(log_prob), axis=1) >= 0).all()
  assert np.isfinite(np.asarray(log_prob)).all()


def test_bad_inputs_give_clear_errors():
  model = sj.load_model("tiny", vocab_size=32)
  enc = np.ones((2, 5), np.int32)
  with pytest.raises(ValueError, match="integer"):
    sj.generate(model, enc.astype(np.float32), max_decode_steps=4)
  with pytest.raises(ValueError, match="rank 2"):
    sj.generate(model, enc[0], max_decode_steps=4)
  with pytest.raises(ValueError, match="max_decode_steps"):
    sj.generate(model, enc, max_decode_steps=0)
  with pytest.raises(ValueError, match="outside"):
    sj.generate(model, enc * 40, max_decode_steps=4)
  cache = model.init_cache(2, 4, enc)
  with pytest.raises(ValueError, match="longer than the cache"):
    model.decode_block(np.ones((2, 6), np.int32), np.zeros(2, np.int32), cache)
  with pytest.raises(ValueError, match="outside the cache"):
    model.decode_block(np.ones((2, 2), np.int32), np.array([0, 3], np.int32), cache)
  with pytest.raises(ValueError, match="encoder_tokens"):
    model.init_cache(2, 4)
