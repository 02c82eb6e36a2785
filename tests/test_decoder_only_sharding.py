"""Sharding decoder-only models through the generic partitioner, as tests/test_sharding.py
does T5: logical axes, the planner, sharded decoding and sharded checkpoint loading on 8
CPU devices, all through the family-neutral functions (`Partitioner.param_shardings(params,
family)`, `plan_memory`, `init_sharded_cache`, `load_sharded_model`, `generate`).

As in tests/test_sharding.py, the tests named `multidevice` run in a
subprocess with 8 CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`).
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from specdec_jax import generate, loading, memory, sharding
from specdec_jax.families.decoder_only import sharding as dos
from specdec_jax.families.decoder_only.config import DECODER_CONFIGS
from specdec_jax.families.decoder_only.family import FAMILY as DECODER_ONLY
from specdec_jax.families.decoder_only.model import DecoderOnlyModel
from specdec_jax.families.registry import family_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTI = jax.device_count() >= 8
multidevice = pytest.mark.skipif(not MULTI, reason="needs 8 devices (run in the subprocess)")


@pytest.mark.parametrize("name", sorted(DECODER_CONFIGS))
def test_logical_axes_cover_every_named_config(name):
  assert family_of(DECODER_CONFIGS[name]) is DECODER_ONLY
  params = DECODER_ONLY.abstract_params(DECODER_CONFIGS[name])
  axes = sharding.params_logical_axes(params, DECODER_ONLY)
  flat = dict(jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))[0])
  assert len(flat) == len(jax.tree_util.tree_leaves(params))
  # The default rules turn every leaf into a spec on a mesh whose axes divide it.
  specs = sharding.Partitioner(sharding.make_mesh("1,1", jax.devices()[:1])).param_specs(
      params, DECODER_ONLY)
  assert len(jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, P))) == len(flat)


def test_logical_axes_of_each_kind_and_errors():
  axes = DECODER_ONLY.param_logical_axes
  assert axes(("layers_0", "self_attn", "k_proj", "kernel"), 2) == ("embed", "joined_kv")
  assert axes(("layers_0", "self_attn", "q_proj", "bias"), 1) == ("joined_kv",)
  assert axes(("layers_0", "mlp", "down_proj", "bias"), 1) == ("embed",)
  assert axes(("embed_positions", "embedding"), 2) == (None, "embed")
  assert axes(("norm", "bias"), 1) == ("embed",)
  with pytest.raises(ValueError, match="decoder-only parameter tree"):
    axes(("decoder", "relpos_bias", "rel_embedding"), 2)
  with pytest.raises(ValueError, match="rank 3"):
    axes(("lm_head", "kernel"), 3)
  # The cache is [batch, length, heads, kv] per layer (T5's is head-major).
  cache = DECODER_ONLY.abstract_cache(DECODER_CONFIGS["llama_tiny"], 2, 5, 4)
  assert DECODER_ONLY.cache_logical_axes(cache)["layers"][0]["self_key"] == dos.CACHE_KV_AXES
  assert cache["layers"][0]["self_key"].shape[1] == DECODER_ONLY.cache_length(
      DECODER_CONFIGS["llama_tiny"], 5, 4)
  with pytest.raises(ValueError, match="expected a decoder-only cache"):
    DECODER_ONLY.cache_logical_axes({"layers": [], "encoder_mask": None})


def test_planner_shards_qwen2_7b_and_flags_few_kv_heads():
  config = DECODER_CONFIGS["qwen2_7b"]
  # 1025-token prompts plus 1024 new tokens: a cache of 2048 positions.
  shape = dict(batch=8, context_len=1025, max_decode_len=1024)
  plan = memory.plan_memory(config, mesh_shape="1,4", dtype="bfloat16", **shape)
  assert plan.params_bytes == 2 * config.num_params
  # Every big weight is split four ways; only norms and biases are replicated.
  assert plan.params_bytes_per_device < 0.26 * plan.params_bytes
  assert plan.cache_bytes == 2 * 28 * 8 * 2048 * 4 * 128 * 2
  assert plan.cache_bytes_per_device == plan.cache_bytes // 4
  # Qwen2-7B has 4 KV heads: an 8-way model axis cannot split its cache.
  with pytest.raises(ValueError, match=r"cache/layers/0/self_key: dimension 2 \('heads', size 4\)"):
    memory.plan_memory(config, mesh_shape="1,8", **shape)
  with pytest.warns(UserWarning, match="Replicating this dimension"):
    replicated = memory.plan_memory(config, mesh_shape="1,8", dtype="bfloat16",
                                      on_indivisible="replicate", **shape)
  assert replicated.cache_bytes_per_device == replicated.cache_bytes
  # The speculative planner takes both models of the family with one context length.
  target, draft = memory.plan_speculative_memory(
      config, DECODER_CONFIGS["qwen2_0_5b"], mesh_shape="2,2", dtype="bfloat16", **shape)
  assert (target.name, draft.name) == ("target", "draft")
  assert target.params_bytes_per_device < target.params_bytes  # Target rules shard weights.
  assert draft.params_bytes_per_device == draft.params_bytes  # Draft weights replicated.
  assert draft.cache_bytes_per_device == draft.cache_bytes // 2  # Batch over data.


# ---------------------------------------------------------------------------
# Eight devices.

@pytest.mark.slow  # long: `make test-slow` (make test stays under 15 minutes)
def test_multidevice_in_subprocess():
  if MULTI:
    pytest.skip("already running with 8 devices")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                       "--xla_backend_optimization_level=0 "
                       "--xla_llvm_disable_expensive_passes=true")
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "multidevice",
       os.path.abspath(__file__)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  summary = result.stdout.strip().splitlines()[-1]
  assert "1 skipped" in summary and "failed" not in summary, result.stdout[-2000:]


BATCH, WIDTH, STEPS = 8, 7, 8
LENGTHS = np.array([5, 2, 7, 3, 6, 1, 4, 7])


@pytest.fixture(scope="module")
def pair():
  # Every sharded dimension divides the 2-way model axis (vocab 96, 2 KV heads).
  base = loading.load_model("llama_tiny", vocab_size=96, seed=1, dtype="float32")
  target = DecoderOnlyModel(base.config, jax.tree_util.tree_map(
      lambda x: x * 5.0 if x.ndim == 2 else x, base.params))
  leaves, treedef = jax.tree_util.tree_flatten(target.params)
  keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
  draft = DecoderOnlyModel(target.config, jax.tree_util.tree_unflatten(
      treedef, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]))
  prompts = np.random.RandomState(0).randint(3, 96, (BATCH, WIDTH)).astype(np.int32)
  return target, draft, prompts


@multidevice
def test_multidevice_sharded_decoding_equals_unsharded(pair):
  target, draft, prompts = pair
  want = generate(target, prompts, LENGTHS, max_decode_steps=STEPS, draft=draft, gamma=3,
                  eos_id=-1)
  target_only = generate(target, prompts, LENGTHS, max_decode_steps=STEPS, eos_id=-1)
  np.testing.assert_array_equal(np.asarray(target_only.sequences), np.asarray(want.sequences))
  assert 0 < want.stats.acceptance_rate < 1  # Both branches of the rejection rule ran.

  target_part, draft_part = sharding.make_partitioners("4,2")
  sharded = loading.shard_model(target, target_part)
  q = sharded.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
  assert q.sharding.spec == P(None, "model")
  assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0], q.shape[1] // 2)}
  assert sharded.params["embed_tokens"]["embedding"].sharding.spec == P("model")
  sharded_draft = loading.shard_model(draft, draft_part)
  draft_q = sharded_draft.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
  assert {s.data.shape for s in draft_q.addressable_shards} == {draft_q.shape}  # Replicated.

  got = generate(sharded, prompts, LENGTHS, max_decode_steps=STEPS, gamma=3, eos_id=-1,
                 draft=sharded_draft)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  np.testing.assert_array_equal(got.stats.accepted, want.stats.accepted)
  # The same under the partitioners: cache pinned, activations constrained.
  got = generate(target, prompts, LENGTHS, max_decode_steps=STEPS, gamma=3, eos_id=-1,
                 draft=draft, partitioner=target_part, draft_partitioner=draft_part)
  assert got.sequences.sharding.mesh == target_part.mesh
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  np.testing.assert_array_equal(got.stats.accepted, want.stats.accepted)
  got = generate(sharded, prompts, LENGTHS, max_decode_steps=STEPS, eos_id=-1,
                 partitioner=target_part)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(target_only.sequences))
  # Sampling under the mesh draws the same tokens as without it.
  sampled = dict(temperature=0.9, topp=0.95, rng=jax.random.PRNGKey(7), eos_id=-1)
  want = generate(target, prompts, LENGTHS, max_decode_steps=STEPS, draft=draft, gamma=3,
                  **sampled)
  got = generate(sharded, prompts, LENGTHS, max_decode_steps=STEPS, draft=sharded_draft,
                 gamma=3, partitioner=target_part, draft_partitioner=draft_part, **sampled)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))


@multidevice
@pytest.mark.parametrize("mesh_shape", ["4,2", "8,1"])
def test_multidevice_planner_matches_allocated_bytes(pair, mesh_shape):
  target, draft, prompts = pair
  target_part, draft_part = sharding.make_partitioners(mesh_shape)
  data = target_part.mesh_shape["data"]
  for model, part in ((target, target_part), (draft, draft_part)):
    sharded = loading.shard_model(model, part)
    cache = sharding.init_sharded_cache(sharded, part, prompts, STEPS, LENGTHS)
    key = cache["layers"][0]["self_key"]
    cache_len = WIDTH + STEPS - 1
    heads = model.config.num_kv_heads // (part.mesh_shape["model"] if part is target_part else 1)
    assert {s.data.shape for s in key.addressable_shards} == {
        (BATCH // data, cache_len, heads, model.config.head_dim)}
    assert key.sharding == part.cache_shardings(cache, DECODER_ONLY)["layers"][0]["self_key"]
    plan = memory.plan_memory(model.config, batch=BATCH, context_len=WIDTH,
                                max_decode_len=STEPS, mesh_shape=part.mesh_shape,
                                rules=part.rules)
    for device in part.mesh.devices.flat:
      assert memory.device_bytes(sharded.params, device) == plan.params_bytes_per_device
      assert memory.device_bytes(cache, device) == plan.cache_bytes_per_device
    assert plan.params_bytes == sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    assert plan.cache_bytes == sum(x.nbytes for x in jax.tree_util.tree_leaves(cache))
    # The prefilled sharded cache holds the unsharded one's values.
    tokens, lengths = DECODER_ONLY.check_inputs(model.config, prompts, LENGTHS, STEPS)
    want = jax.jit(lambda params: DECODER_ONLY.start(
        model.config, params, tokens, lengths, STEPS).cache)(model.params)
    for got, ref in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(want)):
      np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


@multidevice
def test_multidevice_indivisible_errors_and_replicate_mode(pair):
  target, draft, prompts = pair
  part, _ = sharding.make_partitioners("1,8")
  # 2 KV heads: k_proj's joined_kv (2 x head_dim) divides 8, the cache's heads do not.
  with pytest.raises(ValueError, match=r"cache/layers/0/self_key: dimension 2 \('heads', size 2\) "
                     r"is not divisible by mesh axis model=8"):
    sharding.init_sharded_cache(target, part, prompts, STEPS, LENGTHS)
  odd = target.config.replace(vocab_size=90)
  host = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype),
                                DECODER_ONLY.abstract_params(odd))
  with pytest.raises(ValueError, match=r"params/embed_tokens/embedding: dimension 0 \('vocab', "
                     r"size 90\) is not divisible by mesh axis model=8"):
    part.shard_params(host, DECODER_ONLY)
  replicate, _ = sharding.make_partitioners("1,8", on_indivisible="replicate")
  with pytest.warns(UserWarning, match="Replicating"):
    params = replicate.shard_params(host, DECODER_ONLY)
  assert {s.data.shape for s in params["embed_tokens"]["embedding"].addressable_shards} == {
      (90, odd.emb_dim)}
  with pytest.warns(UserWarning, match="Replicating"):
    plan = memory.plan_memory(odd, batch=BATCH, context_len=WIDTH, max_decode_len=STEPS,
                                mesh_shape="1,8", on_indivisible="replicate")
  assert memory.device_bytes(params, jax.devices()[0]) == plan.params_bytes_per_device
  part_2d, _ = sharding.make_partitioners("4,2")
  with pytest.raises(ValueError, match=r"inputs: dimension 0 \('batch', size 6\) is not "
                     r"divisible by mesh axis data=4"):
    generate(target, prompts[:6], LENGTHS[:6], max_decode_steps=STEPS, draft=draft,
             partitioner=part_2d)


@multidevice
def test_multidevice_deepseek_latent_cache_replicated_over_model_equals_unsharded():
  """DeepSeek-V3's latent cache [batch, length, 1, kv_lora + rope] has no heads axis: batch
  over `data`, replicated over `model` (families/decoder_only/sharding.py), while the
  absorbed queries split with the heads. Greedy speculative decoding under a 2x4 mesh
  equals unsharded, and the planner's per-device bytes are the allocated ones."""
  base = loading.load_model("deepseek_v3_tiny", vocab_size=96, seed=3, dtype="float32")
  target = DecoderOnlyModel(base.config, jax.tree_util.tree_map(
      lambda x: x * 3.0 if x.ndim == 2 else x, base.params))
  draft = loading.load_model("llama_tiny", vocab_size=96, seed=5, dtype="float32")
  prompts = np.random.RandomState(0).randint(3, 96, (BATCH, WIDTH)).astype(np.int32)
  target_part, draft_part = sharding.make_partitioners("2,4")
  sharded = loading.shard_model(target, target_part)
  cache = sharding.init_sharded_cache(sharded, target_part, prompts, STEPS, LENGTHS)
  key = cache["layers"][0]["self_key"]
  assert set(cache["layers"][0]) == {"self_key"} and key.sharding.spec == P("data")
  plan = memory.plan_memory(target.config, batch=BATCH, context_len=WIDTH, max_decode_len=STEPS,
                            mesh_shape="2,4")
  assert memory.device_bytes(cache, jax.devices()[0]) == plan.cache_bytes_per_device == (
      plan.cache_bytes // 2)
  kw = dict(max_decode_steps=STEPS, draft=draft, gamma=3, eos_id=-1)
  want = generate(target, prompts, LENGTHS, **kw)
  got = generate(sharded, prompts, LENGTHS, partitioner=target_part,
                 draft_partitioner=draft_part, **kw)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  np.testing.assert_array_equal(got.stats.accepted, want.stats.accepted)


def _at(tree, key):
  for name in key:
    tree = tree[name]
  return tree


@multidevice
def test_multidevice_hf_directory_loads_straight_into_shards(tmp_path, record_placements):
  model = loading.load_model("qwen2_tiny", vocab_size=96, seed=4, dtype="float32")
  loading.export_hf(model, tmp_path)
  target_part, _ = sharding.make_partitioners("2,4")
  placed = record_placements(DECODER_ONLY)
  loaded = loading.load_sharded_model(tmp_path, target_part, dtype="float32")
  expected = target_part.param_shardings(model.params, DECODER_ONLY)
  # Every tensor landed in its final sharding as it was read.
  assert len(placed) == len(jax.tree_util.tree_leaves(model.params))
  for key, sharding_ in placed:
    assert sharding_ == _at(expected, key), key
  for got, want, sharding_ in zip(jax.tree_util.tree_leaves(loaded.params),
                                  jax.tree_util.tree_leaves(model.params),
                                  jax.tree_util.tree_leaves(expected)):
    assert got.sharding == sharding_
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # Random weights are initialised straight into their shardings.
  fresh = loading.load_sharded_model("qwen2_tiny", target_part, vocab_size=96, seed=4,
                                     dtype="float32")
  for got, want, sharding_ in zip(jax.tree_util.tree_leaves(fresh.params),
                                  jax.tree_util.tree_leaves(model.params),
                                  jax.tree_util.tree_leaves(expected)):
    assert got.sharding == sharding_
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@multidevice
@pytest.mark.parametrize("dispatch", ["dense", "gather"])
def test_multidevice_moe_experts_split_equals_unsharded(dispatch):
  """A Mixtral-layout target with whole experts split over a 4-way model axis
  (`sharding.EXPERT_PARALLEL_RULES`, configs/sharding/expert_parallel.gin) decodes as
  unsharded, greedy and sampled, speculative with a draft of its layout: routing runs
  inside the compiled step on every device."""
  # 4 KV heads and 96 ids: every sharded dimension divides the 4-way model axis.
  base = loading.load_model("mixtral_tiny", vocab_size=96, seed=1, dtype="float32",
                            num_kv_heads=4, moe_dispatch=dispatch)
  target = DecoderOnlyModel(base.config, jax.tree_util.tree_map(
      lambda x: x * 3.0 if x.ndim >= 2 else x, base.params))
  draft = loading.load_model("mixtral_tiny", vocab_size=96, seed=5, dtype="float32",
                             num_layers=1, num_kv_heads=4, moe_dispatch=dispatch)
  prompts = np.random.RandomState(0).randint(3, 96, (BATCH, WIDTH)).astype(np.int32)
  mesh_target, mesh_draft = sharding.make_partitioners(
      "2,4", logical_axis_rules=sharding.EXPERT_PARALLEL_RULES)
  sharded = loading.shard_model(target, mesh_target)
  experts = [x for path, x in jax.tree_util.tree_flatten_with_path(sharded.params)[0]
             if x.ndim == 3]
  assert experts and all(x.sharding.spec[0] == "model" for x in experts)  # whole experts
  assert all({s.data.shape[0] for s in x.addressable_shards} == {x.shape[0] // 4}
             for x in experts)
  for sampled in ({}, dict(temperature=1.0, rng=jax.random.PRNGKey(3))):
    kw = dict(max_decode_steps=STEPS, draft=draft, gamma=3, eos_id=-1, **sampled)
    want = generate(target, prompts, LENGTHS, **kw)
    got = generate(sharded, prompts, LENGTHS, partitioner=mesh_target,
                   draft_partitioner=mesh_draft, **kw)
    np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
    np.testing.assert_array_equal(got.stats.accepted, want.stats.accepted)
    if not sampled:
      alone = generate(target, prompts, LENGTHS, max_decode_steps=STEPS, eos_id=-1)
      np.testing.assert_array_equal(np.asarray(alone.sequences), np.asarray(want.sequences))
