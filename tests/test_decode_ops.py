"""The fused decode step (families/t5/decode.py): same function as the reference, fewer operations.

`tests/test_model.py` checks cached blocks (now this path) against the
uncached forward pass; here: against the reference `T5.decode_block`, inside
a decode loop, and the compiled operation count per decoder layer.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax import demo_pair
from specdec_jax.core import decoding
from specdec_jax.tools import hlo_ops
from specdec_jax.tools import testing
from specdec_jax.families.t5 import decode as t5_decode
from specdec_jax.families.t5.network import T5


def _reference_block_fn(config):
  return lambda params: (lambda tokens, positions, cache: T5(config).apply(
      {"params": params}, tokens, positions, cache, method=T5.decode_block))


def _fast_block_fn(config, attention=None):
  return lambda params: t5_decode.block_fn(params, config, attention)


def _greedy_loop(config, block_fn_for, steps):
  """jit: greedy target-only decoding (EOS disabled) through a block callback."""

  def run(params, encoder_tokens):
    cache = T5(config).apply({"params": params}, encoder_tokens, steps, method=T5.init_cache)
    inputs = jnp.zeros((encoder_tokens.shape[0], steps), jnp.int32)
    decodes, _ = decoding.temperature_sample(
        inputs, cache, decoding.block_to_state_fn(block_fn_for(params)), -1, temperature=0.0,
        topk=0)
    return decodes[:, 0]

  return jax.jit(run)


@pytest.mark.parametrize("variant,dtype,attention", [
    ("gated_untied", "float32", "dots"), ("gated_untied", "float32", "in_layout"),
    ("relu_tied", "float32", "dots"), ("relu_tied", "float32", "in_layout"),
    ("gated_untied", "bfloat16", "in_layout")])
def test_block_equals_reference_block(variant, dtype, attention):
  """Logits and the whole new cache, rows at different positions, one at the cache's end."""
  overrides = dict(vocab_size=97, num_heads=3, head_dim=8, num_decoder_layers=3)
  if variant == "relu_tied":
    overrides.update(mlp_activations=("relu",), logits_via_embedding=True)
  model = sj.load_model("tiny", dtype=dtype, seed=2, **overrides)
  enc = testing.random_encoder_tokens(3, 7, 97, seed=1)
  cache = model.init_cache(3, 12, enc)
  tokens = jnp.array([[5, 6, 7], [8, 9, 10], [11, 12, 13]], jnp.int32)
  positions = jnp.array([0, 4, 10], jnp.int32)  # row 2's last key falls off the cache
  # Called directly: Model.decode_block rejects blocks that run past the cache.
  ref_logits, ref_cache = jax.jit(lambda p, t, s, c: _reference_block_fn(model.config)(p)(t, s, c))(
      model.params, tokens, positions, cache)
  logits, new_cache = jax.jit(lambda p, t, s, c: _fast_block_fn(model.config, attention)(p)(
      t, s, c))(model.params, tokens, positions, cache)
  f32 = lambda x: np.asarray(x, np.float32)
  # bfloat16: the norm scale is folded into bf16 kernels (one more rounding).
  rtol = 1e-5 if dtype == "float32" else 3e-2
  scale = np.abs(f32(ref_logits)).max()
  np.testing.assert_allclose(f32(logits), f32(ref_logits), rtol=rtol, atol=rtol * scale)
  assert jax.tree_util.tree_structure(new_cache) == jax.tree_util.tree_structure(ref_cache)
  for got, want in zip(jax.tree_util.tree_leaves(new_cache), jax.tree_util.tree_leaves(ref_cache)):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(f32(got), f32(want), rtol=rtol, atol=rtol * (np.abs(f32(want)).max() + 1))


def test_greedy_decode_loop_equals_reference_loop():
  """Batch 1, 64 steps: where XLA CPU miscompiled the in-layout cross-attention read
  (without the optimization barrier in decode_block, 'in_layout' fails here)."""
  config = sj.get_config("tiny", vocab_size=128, emb_dim=32, mlp_dim=64, num_heads=4,
                         head_dim=64, num_encoder_layers=1, num_decoder_layers=2,
                         dtype="float32")
  model = sj.load_model(config, seed=0)
  tokens = testing.random_encoder_tokens(1, 32, 128, seed=0, min_length=32)
  want = _greedy_loop(config, _reference_block_fn(config), 64)(model.params, tokens)
  for attention in ("dots", "in_layout"):
    got = _greedy_loop(config, _fast_block_fn(config, attention), 64)(model.params, tokens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=attention)
  # generate runs Model.block_fn, i.e. this path.
  out = sj.generate(model, tokens, max_decode_steps=64, eos_id=-1)
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want))


def test_prepared_kernels_fold_norm_scales_and_stack():
  model = sj.load_model("tiny", vocab_size=50, seed=1)
  cfg, p = model.config, model.params
  prepared = t5_decode.prepare_decode_params(p, cfg)
  layer = p["decoder"]["layers_1"]
  fused = prepared["layers"][1]
  inner = cfg.num_heads * cfg.head_dim
  assert fused["qkv"].shape == (cfg.emb_dim, 3, inner)
  assert fused["wi"].shape == (cfg.emb_dim, 2, cfg.mlp_dim)
  scale = np.asarray(layer["pre_self_attention_layer_norm"]["scale"])[:, None]
  np.testing.assert_allclose(np.asarray(fused["qkv"][:, 1]),
                             scale * np.asarray(layer["self_attention"]["key"]["kernel"]),
                             rtol=1e-6)
  scale = np.asarray(layer["pre_mlp_layer_norm"]["scale"])[:, None]
  np.testing.assert_allclose(np.asarray(fused["wi"][:, 1]),
                             scale * np.asarray(layer["mlp"]["wi_1"]["kernel"]), rtol=1e-6)


def test_bad_layouts_and_options_are_named():
  model = sj.load_model("tiny", vocab_size=50)
  with pytest.raises(ValueError, match="layers_2"):
    t5_decode.prepare_decode_params(model.params, model.config.replace(num_decoder_layers=3))
  cache = model.init_cache(1, 4, np.ones((1, 3), np.int32))
  with pytest.raises(ValueError, match="attention must be one of"):
    t5_decode.block_fn(model.params, model.config, "flash")(
        jnp.ones((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32), cache)
  with pytest.raises(ValueError, match="prefix_chunk must be an int >= 0"):
    t5_decode.block_fn(model.params, model.config, "dots", prefix_chunk=-4)(
        jnp.ones((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32), cache)


def _prefix_case(dtype, attention="dots"):
  """A 3-layer model whose cache rows were filled to different depths, block by block."""
  model = sj.load_model("tiny", dtype=dtype, seed=2, vocab_size=97, num_heads=3, head_dim=8,
                        num_decoder_layers=3)
  prepared = t5_decode.prepare_decode_params(model.params, model.config)
  enc = testing.random_encoder_tokens(3, 7, 97, seed=1)
  block = jax.jit(lambda tokens, positions, cache, chunk: t5_decode.decode_block(
      prepared, model.config, tokens, positions, cache, attention, prefix_chunk=chunk),
      static_argnums=3)

  def filled_cache(max_len, chunk):
    cache = model.init_cache(3, max_len, enc)
    rng = np.random.default_rng(0)
    for start in range(0, 40, 4):
      tokens = jnp.asarray(rng.integers(0, 97, (3, 4)), jnp.int32)
      _, cache = block(tokens, jnp.full((3,), start, jnp.int32), cache, chunk)
    return cache

  tokens = jnp.array([[5, 6, 7], [8, 9, 10], [11, 12, 13]], jnp.int32)
  return block, filled_cache, tokens


# bf16 (34 s here) runs in make test-slow (the make test budget); its bits are checked below.
@pytest.mark.parametrize("dtype,attention", [
    ("float32", "dots"), ("float32", "in_layout"),
    pytest.param("bfloat16", "dots", marks=pytest.mark.slow)])
def test_prefix_attention_equals_attention_over_the_whole_cache(dtype, attention):
  """Chunks that divide the cache and chunks that do not (the last one shifted back),
  rows at different depths, one row's block running past the cache's end; on both paths
  (the prefix loop is every backend's default)."""
  block, filled_cache, tokens = _prefix_case(dtype, attention)
  positions = jnp.array([40, 20, 98], jnp.int32)
  f32 = lambda x: np.asarray(x, np.float32)
  rtol = 1e-5 if dtype == "float32" else 3e-2
  cache = filled_cache(100, 0)
  whole_logits, whole_cache = block(tokens, positions, cache, 0)
  scale = np.abs(f32(whole_logits)).max()
  for chunk in (8, 12, 47, 99):
    logits, new_cache = block(tokens, positions, cache, chunk)
    np.testing.assert_allclose(f32(logits), f32(whole_logits), rtol=rtol, atol=rtol * scale)
    for got, want in zip(jax.tree_util.tree_leaves(new_cache),
                         jax.tree_util.tree_leaves(whole_cache)):
      # Layer 1's keys and values are layer 0's attention output: equal to rounding.
      np.testing.assert_allclose(f32(got), f32(want), rtol=rtol,
                                 atol=rtol * (np.abs(f32(want)).max() + 1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefix_attention_bits_depend_on_neither_cache_length_nor_batch_mates(dtype):
  """The chunks past a row's last key change its softmax state by exactly nothing."""
  block, filled_cache, tokens = _prefix_case(dtype)
  short, long_ = filled_cache(48, 8), filled_cache(128, 8)
  positions = jnp.array([40, 20, 33], jnp.int32)
  np.testing.assert_array_equal(np.asarray(block(tokens, positions, short, 8)[0]),
                                np.asarray(block(tokens, positions, long_, 8)[0]))
  # Row 2 moving from position 33 to 100 runs 13 chunks instead of 5 for every row.
  near = np.asarray(block(tokens, jnp.array([10, 20, 33], jnp.int32), long_, 8)[0])
  far = np.asarray(block(tokens, jnp.array([10, 20, 100], jnp.int32), long_, 8)[0])
  np.testing.assert_array_equal(near[:2], far[:2])
  assert not np.array_equal(near[2], far[2])


def test_softmax_matches_jax_and_survives_masked_rows():
  scores = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 70, 4)) * 30
  np.testing.assert_allclose(np.asarray(t5_decode.softmax(scores, axis=2)),
                             np.asarray(jax.nn.softmax(scores, axis=2)), rtol=1e-5, atol=1e-7)
  masked = jnp.full((1, 1, 40, 2), -1e10)  # an all-padding row: uniform, not NaN
  np.testing.assert_allclose(np.asarray(t5_decode.softmax(masked, axis=2)), 1 / 40, rtol=1e-6)


# Operations one decoder layer adds to the compiled decode step (hlo_ops),
# measured with jax 0.10.2 on CPU for the shipped demo target's shape (the
# reference linen path: 50 at k=1, 52 at k=5). A change that adds operations
# fails here; one that removes some should lower the pin.
# dots at k=5: 35, two more than the select pass that rewrote the whole
# cache per layer and step (33): the in-place scatter's in-bounds window of
# the key and value caches, two O(k) fusions, for a write that no longer
# grows with the cache (issue 21; BENCHMARKS.md).
# All four +6 since the norms' sums became trees of adds (`core.rows`, issue 55): XLA
# CPU materialises each norm's squares and splits its tree in two fusions (3 where
# the staged reduction was 1), 2 more per norm, 3 norms a layer; the price of a row's
# bits not depending on its batch (a reduction goes to YNNPACK past 4096 elements).
PINNED_OPS_PER_LAYER = {("in_layout", 1): 39, ("in_layout", 5): 35,
                        ("dots", 1): 42, ("dots", 5): 41}


@pytest.fixture(scope="module")
def demo_target_config():
  with open(f"{demo_pair.DEFAULT_DIR}/config.json") as f:
    return demo_pair.config_from_json(json.load(f)["models"]["target"]).replace(dtype="float32")


@pytest.mark.parametrize("attention,k", sorted(PINNED_OPS_PER_LAYER))
def test_pinned_operations_per_decoder_layer(demo_target_config, attention, k):
  ops = hlo_ops.ops_per_layer(demo_target_config, k,
                              lambda cfg: _fast_block_fn(cfg, attention))
  pinned = PINNED_OPS_PER_LAYER[(attention, k)]
  assert ops["total"] <= pinned, (
      f"the compiled decode step ({attention}) now runs {ops['total']} operations per decoder "
      f"layer at k={k} (pinned: {pinned}): {ops}")
  # No per-layer copy of the cache, no loop or branch per layer.
  assert not {"copy", "while", "conditional"} & set(ops), ops


def test_count_ops_reads_scheduled_computations_only():
  text = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y) * 2 + 1, x)).lower(
      jnp.ones(4), 3).compile().as_text()
  ops = hlo_ops.count_ops(text)
  assert ops["while"] == 1 and sum(ops.values()) >= 2
  with pytest.raises(ValueError, match="ENTRY"):
    hlo_ops.count_ops("not hlo")


@pytest.mark.parametrize("k", [1, 5])
def test_cpu_cache_write_grows_with_the_cache_only_as_reading_does(demo_target_config, k):
  """The 'dots' step at longer caches: no copy of the cache, and operations that do
  not depend on its length (so nothing is added per position). Caches longer than
  `PREFIX_CHUNK` add one loop per layer, over the written prefix's chunks
  (`_attend_dots_prefix`), whose body is the same at 512 and 1024 positions. For
  k >= 2 the cache write is in place (one dynamic-update-slice fusion per cache,
  reading no whole cache); at k = 1 it stays the one select pass (`_blend_block`)."""
  if jax.default_backend() != "cpu":
    pytest.skip("the 'dots' path's compiled form is XLA CPU's")
  block_fn_for = lambda cfg: _fast_block_fn(cfg, "dots")
  assert t5_decode.PREFIX_CHUNK < 512
  # (At the pinned tests' short cache: no copy, loop or branch at all.)
  mid = hlo_ops.ops_per_layer(demo_target_config, k, block_fn_for, max_len=512)
  long = hlo_ops.ops_per_layer(demo_target_config, k, block_fn_for, max_len=1024)
  assert mid == long and long["while"] == 1, (mid, long)
  text = hlo_ops.compiled_block_text(demo_target_config.replace(num_decoder_layers=1), k,
                                     block_fn_for(demo_target_config.replace(
                                         num_decoder_layers=1)), max_len=1024)
  cache_copies = [line for line in text.splitlines()
                  if " copy(" in line and "f32[1,4,1024,64]" in line.split(" copy(")[0]]
  assert not cache_copies, cache_copies
  writes = [line for line in text.splitlines()
            if "fusion(" in line and "f32[1,4,1024,64]" in line.split("fusion(")[0]]
  if k > 1:
    # One write per cache, a scatter (or dynamic-update-slice) into the carried
    # buffer itself: in place.
    assert len(writes) == 2, writes
    for write in writes:
      assert "scatter" in write or "dynamic-update-slice" in write, write
      assert write.split("fusion(")[1].startswith("%get-tuple-element"), write
