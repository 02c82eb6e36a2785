"""DeepSeek-V3's latent cache (`DecoderOnlyConfig.mla_cache`, `network.MlaAttention`).

* bytes: the planner (`sj.plan_memory`, from `family.abstract_cache`) reports (kv_lora_rank
  + qk_rope_head_dim) values per token and layer for the named DeepSeek-V3, against heads *
  (nope + rope + v) with mla_cache 'full' (71x); the latent is replicated over `model`.
* identity: the latent path is the 'full' path's function: logits of a prefill and decode
  blocks to float32 rounding (a cache past attention_chunk, so the chunked loop runs; both
  kernel layouts), greedy outputs token for token in float32 for target-only and a chain
  draft (tree, block verification and `generate_many`: marked slow);
* bfloat16: on the latent path every draft kind equals target-only token for token (chain
  and tree; block verification and `generate_many`: marked slow).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.families.decoder_only import sharding as dos
from specdec_jax.families.decoder_only.config import DECODER_CONFIGS
from specdec_jax.families.kernel_layout import with_kernel_layout
from specdec_jax.families.registry import family_of

CHUNK = 16  # < the 40-token prompts: the cached blocks read the cache in chunks.
LENGTHS = np.array([40, 23, 31], np.int32)
KW = dict(max_decode_steps=30, eos_id=-1, block_width=5)


def _target(dtype="float32", mla_cache="latent", layout="in_out"):
  """deepseek_v3_tiny (vocab 64), its 2-D weights x3 so the softmaxes are far from uniform
  (at init every score is ~0 and a wrong key would hardly show), in `dtype`."""
  base = sj.load_model("deepseek_v3_tiny", vocab_size=64, seed=3, dtype="float32")
  params = jax.tree_util.tree_map(lambda x: (x * 3.0 if x.ndim == 2 else x).astype(dtype),
                                  base.params)
  config = base.config.replace(attention_chunk=CHUNK, dtype=dtype, mla_cache=mla_cache)
  return with_kernel_layout(family_of(base).model_type(config, params), layout)


def _draft(dtype="float32"):
  base = sj.load_model("llama_tiny", vocab_size=64, seed=5, dtype="float32")
  params = jax.tree_util.tree_map(lambda x: x.astype(dtype), base.params)
  return family_of(base).model_type(base.config.replace(dtype=dtype), params)


def _prompts(seed=1):
  return np.random.RandomState(seed).randint(3, 64, size=(3, 40)).astype(np.int32)


def _block_logits(model, prompts, max_len=64):
  """[prefill logits [3, vocab], block logits [3, 5, vocab] x 2]: a prefill of ragged
  prompts, then two 5-token blocks at each row's length (the second after the first)."""
  cache = model.init_cache(3, max_len)
  last, cache = model.prefill(prompts, LENGTHS, cache)
  out = [np.asarray(last)]
  positions = jnp.asarray(LENGTHS)
  for start in (0, 5):
    logits, cache = model.decode_block(prompts[:, start:start + 5], positions + start, cache)
    out.append(np.asarray(logits))
  return out


def test_latent_cache_bytes_per_token_and_layer_for_deepseek_v3():
  config = DECODER_CONFIGS["deepseek_v3"]
  context, decode = 4096, 1024
  positions = config.num_layers * (context + decode - 1)
  per_token = {}
  for mode in ("latent", "full"):
    plan = sj.plan_memory(config.replace(mla_cache=mode), batch=1, context_len=context,
                          max_decode_len=decode, mesh_shape=(1, 1))
    assert plan.cache_bytes % positions == 0
    per_token[mode] = plan.cache_bytes // positions
  itemsize = jnp.dtype(config.dtype).itemsize
  ratio = per_token["full"] / per_token["latent"]
  message = (f"bytes per token and layer: latent {per_token['latent']}, full "
             f"{per_token['full']}, ratio {ratio:.1f}x")
  print(message)
  assert per_token["latent"] == (config.kv_lora_rank + config.qk_rope_head_dim) * itemsize, message
  assert per_token["full"] == config.num_heads * (
      config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim) * itemsize, message
  assert 70 < ratio < 72, message
  # The latent has no heads axis: replicated over `model`, batch over `data` (the tiny
  # shape: planning the full one again would trace its 61 layers a third time).
  tiny = DECODER_CONFIGS["deepseek_v3_tiny"].replace(vocab_size=64)
  split = sj.plan_memory(tiny, batch=2, context_len=8, max_decode_len=4, mesh_shape=(2, 4))
  assert split.cache_bytes_per_device == split.cache_bytes // 2
  cache = family_of(tiny).abstract_cache(tiny, 2, 8, 4)
  assert set(cache["layers"][0]) == {"self_key"}
  assert family_of(tiny).cache_logical_axes(cache)["layers"][0]["self_key"] == (
      dos.CACHE_LATENT_AXES)


@pytest.mark.parametrize("layout", ["in_out", "out_in"])
def test_logits_equal_the_full_cache(layout):
  prompts = _prompts()
  latent = _target(layout=layout)
  assert latent.init_cache(1, 4)["layers"][0]["self_key"].shape == (1, 4, 1, 24 + 8)
  got = _block_logits(latent, prompts)
  want = _block_logits(_target(mla_cache="full", layout=layout), prompts)
  for g, w in zip(got, want):
    assert np.abs(w).max() > 1.0, "near-zero logits would prove nothing"
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
  # The latent's key half matters: kv_b_proj's W_uk zeroed moves the logits.
  params = jax.tree_util.tree_map(lambda x: x, latent.params)
  for i in range(latent.config.num_layers):
    attn = params[f"layers_{i}"]["self_attn"]["kv_b_proj"]
    kernel = np.asarray(attn["kernel"]).copy()  # heads 4, nope 16, v 12
    if layout == "in_out":
      kernel.reshape(-1, 4, 28)[..., :16] = 0
    else:
      kernel.reshape(4, 28, -1)[:, :16] = 0
    attn["kernel"] = jnp.asarray(kernel)
  moved = _block_logits(type(latent)(latent.config, params), prompts)
  assert np.abs(moved[2] - got[2]).max() > 1e-2


def _runs(target, dtype, kinds=("target", "chain", "tree", "block", "generate_many")):
  """{kind: sequences [3, 30]} for target-only, each draft kind and `generate_many`."""
  draft = _draft(dtype)
  prompts = _prompts()
  options = {"target": {}, "chain": dict(draft=draft, gamma=3),
             "tree": dict(draft=sj.TreeDraft(draft, (2, 1)), gamma=2),
             "block": dict(draft=draft, gamma=3, verification="block")}
  out = {what: np.asarray(sj.generate(target, prompts, LENGTHS, **KW, **options[what]).sequences)
         for what in kinds if what != "generate_many"}
  if "generate_many" in kinds:
    out["generate_many"] = np.asarray(sj.generate_many(
        target, prompts, LENGTHS, batch_size=2, draft=draft, gamma=3, **KW).sequences)
  return out


def _check_float32_identity(kinds):
  """The latent path's greedy outputs equal the full cache's, and target-only's."""
  latent = _runs(_target(), "float32", kinds)
  full = _runs(_target(mla_cache="full"), "float32", ("target",) + kinds[1:])
  assert len(set(full["target"].ravel().tolist())) >= 8, "degenerate outputs prove nothing"
  for what in latent:
    np.testing.assert_array_equal(latent[what], full["target"], err_msg=what)
    if what in full:
      np.testing.assert_array_equal(latent[what], full[what], err_msg=what)


def test_float32_greedy_equals_the_full_cache():
  _check_float32_identity(("target", "chain"))


@pytest.mark.slow
def test_float32_greedy_equals_the_full_cache_for_trees_blocks_and_generate_many():
  _check_float32_identity(("target", "tree", "block", "generate_many"))


def _check_bfloat16(kinds):
  """bf16 rounds the absorbed and expanded forms differently, so each draft kind is held
  to the latent path's own target-only outputs, token for token."""
  runs = _runs(_target("bfloat16"), "bfloat16", kinds)
  assert len(set(runs["target"].ravel().tolist())) >= 8, "degenerate outputs prove nothing"
  for what, sequences in runs.items():
    np.testing.assert_array_equal(sequences, runs["target"], err_msg=what)


def test_bfloat16_speculative_equals_target_only_on_the_latent_path():
  _check_bfloat16(("target", "chain", "tree"))


@pytest.mark.slow
def test_bfloat16_block_verification_and_generate_many_equal_target_only():
  _check_bfloat16(("target", "block", "generate_many"))


def test_a_bad_mla_cache_is_refused():
  with pytest.raises(ValueError, match=r"mla_cache must be one of \('latent', 'full'\)"):
    DECODER_CONFIGS["deepseek_v3_tiny"].replace(mla_cache="compressed")
