"""Attention over the written prefix (`families/decoder_only/prefix_attention.py`).

Two promises, tested where the math makes them:
* bits: a block's logits do not depend on how many chunks run (the allocated length, how
  far the batch's other rows have got), so they are compared exactly;
* against the whole-cache path (attention_chunk=0) the function is the same and only the
  rounding differs: logits to float tolerance, greedy outputs token for token in float32;
* speculative decoding stays bit-identical to target-only on the prefix path, for chains,
  trees, block verification and `generate_many`, in float32 and bfloat16.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.families.decoder_only.prefix_attention import KeyMask, attend
from specdec_jax.families.registry import family_of

CHUNK = 16


def _model(name: str, dtype: str = "float32", chunk: int = CHUNK, seed: int = 3):
  model = sj.load_model(name, vocab_size=64, seed=seed, dtype="float32")
  config = model.config.replace(attention_chunk=chunk, dtype=dtype)
  params = jax.tree_util.tree_map(lambda x: x.astype(dtype), model.params)
  return family_of(model).model_type(config, params)


def _prompts(batch: int, width: int, seed: int = 0):
  rng = np.random.RandomState(seed)
  return rng.randint(3, 64, size=(batch, width)).astype(np.int32)


def _logits_after(model, prompts, positions, max_len):
  """Block logits of two tokens at `positions` after prefilling `prompts` into a cache of
  `max_len` positions."""
  cache = model.init_cache(prompts.shape[0], max_len)
  _, cache = model.prefill(prompts, None, cache)
  tokens = jnp.asarray(prompts[:, :2])
  logits, _ = model.decode_block(tokens, jnp.asarray(positions, jnp.int32), cache)
  return np.asarray(logits)


@pytest.mark.parametrize("name", ["llama_tiny", "gpt_oss_tiny"])
def test_the_bits_do_not_depend_on_how_many_chunks_run(name):
  model = _model(name)
  prompts = _prompts(2, 96)
  # Row 0 at position 20 (2 chunks); row 1 at 20 or 90: the loop then runs 2 or 6 chunks.
  near = _logits_after(model, prompts, [20, 20], 96)
  far = _logits_after(model, prompts, [20, 90], 96)
  np.testing.assert_array_equal(near[0], far[0])
  # The allocated length: 96, 100 (chunks not tiling it) or 128 positions, the same bits.
  for max_len in (100, 128):
    np.testing.assert_array_equal(far, _logits_after(model, prompts, [20, 90], max_len))
  # Against reading every key: the same function, rounded differently.
  whole = _logits_after(_model(name, chunk=0), prompts, [20, 90], 128)
  np.testing.assert_allclose(far, whole, rtol=1e-5, atol=1e-5)


def test_attend_with_sinks_and_softcap_matches_one_softmax():
  """The chunked merge against the whole softmax on random arrays: GQA, a soft-cap, sink
  logits, a window, a shifted last chunk (40 keys in chunks of 16)."""
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  query = jax.random.normal(keys[0], (2, 3, 4, 8))
  key = jax.random.normal(keys[1], (2, 40, 2, 8))
  value = jax.random.normal(keys[2], (2, 40, 2, 6))
  sinks = jax.random.normal(keys[3], (4,))
  positions = jnp.array([30, 36])
  query_at = positions[:, None] + jnp.arange(3)[None]
  for window in (None, 7):
    mask = KeyMask(query_at, jnp.max(positions) + 3, window=window)
    args = (2, 0.35, 5.0, sinks)
    chunked = attend(query, key, value, mask, *args, chunk=16)
    whole = attend(query, key, value, mask, *args, chunk=0)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=1e-5, atol=1e-6)


def _drafts(target, dtype):
  drafter = _model("llama_tiny", dtype, seed=5)
  return {"chain": (drafter, dict(gamma=3)),
          "tree": (sj.TreeDraft(drafter, (2, 1)), dict(gamma=2)),
          "block": (drafter, dict(gamma=3, verification="block"))}


def _check_greedy_outputs(name, dtype):
  """Target-only on the prefix path against the whole-cache path (float32: token for
  token; bfloat16: the logits' rounding differs, so against its own longer decode: the
  allocation changes no bit), and every draft kind against it, token for token."""
  prefix = _model(name, dtype)
  prompts = _prompts(3, 40, seed=1)
  lengths = np.array([40, 23, 31], np.int32)
  kw = dict(max_decode_steps=30, eos_id=-1, block_width=5)
  expected = np.asarray(sj.generate(prefix, prompts, lengths, **kw).sequences)
  longer = sj.generate(prefix, prompts, lengths, **{**kw, "max_decode_steps": 70})
  np.testing.assert_array_equal(np.asarray(longer.sequences)[:, :30], expected,
                                err_msg="a longer cache")
  if dtype == "float32":
    whole = sj.generate(_model(name, dtype, chunk=0), prompts, lengths, **kw)
    np.testing.assert_array_equal(np.asarray(whole.sequences), expected, err_msg="whole cache")
  for what, (draft, extra) in _drafts(prefix, dtype).items():
    out = sj.generate(prefix, prompts, lengths, draft=draft, **{**kw, **extra})
    np.testing.assert_array_equal(np.asarray(out.sequences), expected, err_msg=what)
  many = sj.generate_many(prefix, prompts, lengths, batch_size=2, draft=_drafts(prefix, dtype)
                          ["chain"][0], gamma=3, **kw)
  np.testing.assert_array_equal(np.asarray(many.sequences), expected, err_msg="generate_many")


@pytest.mark.parametrize("name,dtype", [("llama_tiny", "float32"),
                                        ("gpt_oss_tiny", "bfloat16")])
def test_greedy_outputs_on_the_prefix_path(name, dtype):
  _check_greedy_outputs(name, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype", [("llama_tiny", "bfloat16"), ("gpt_oss_tiny", "float32"),
                                        ("mixtral_tiny", "float32"),
                                        ("mixtral_tiny", "bfloat16"),
                                        ("deepseek_v3_tiny", "float32")])
def test_greedy_outputs_on_the_prefix_path_other_layouts(name, dtype):
  _check_greedy_outputs(name, dtype)


def test_bfloat16_logits_stay_near_the_whole_cache_path():
  prompts = _prompts(2, 96)
  got = _logits_after(_model("llama_tiny", "bfloat16"), prompts, [20, 90], 100)
  whole = _logits_after(_model("llama_tiny", "bfloat16", chunk=0), prompts, [20, 90], 100)
  np.testing.assert_allclose(got, whole, atol=0.05)


def test_a_bad_attention_chunk_is_refused():
  with pytest.raises(ValueError, match="attention_chunk must be an int >= 0"):
    sj.load_model("llama_tiny").config.replace(attention_chunk=-1)
