"""Sharding T5 through the generic partitioner: logical axes, rules, meshes, the
memory planner, sharded generate, sharded checkpoint loading.

tests/test_decoder_only_sharding.py proves the same for decoder-only models
through the same functions (`Partitioner.param_shardings(params, family)`,
`plan_memory`, `init_sharded_cache`, `load_sharded_model`, ...).

The device count is fixed when JAX starts, so the tests named `multidevice`
run in a subprocess with 8 CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`); when this file is run
with 8 devices already (as that subprocess does), they run directly.
"""

import os
import subprocess
import sys

import gin
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from specdec_jax import drafts as sj_drafts
from specdec_jax import generate, loading, memory, multihost, sharding
from specdec_jax.families.registry import family_of
from specdec_jax.families.t5 import network as t5
from specdec_jax.families.t5 import sharding as t5_sharding
from specdec_jax.families.t5.config import get_config
from specdec_jax.families.t5.family import FAMILY as T5
from specdec_jax.tools.testing import random_encoder_tokens, tiny_pair

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MULTI = jax.device_count() >= 8
multidevice = pytest.mark.skipif(not MULTI, reason="needs 8 devices (run in the subprocess)")

# Every dimension a mesh axis shards divides 8. One layer per stack keeps
# compiles short: sharding does not depend on depth.
TINY = dict(vocab_size=64, num_heads=8, head_dim=8, emb_dim=32, mlp_dim=64,
            num_encoder_layers=1, num_decoder_layers=1)
BATCH, ENC_LEN, STEPS, GAMMA = 8, 8, 12, 3
SAMPLING = dict(temperature=0.9, topp=0.95)
MESHES = ["1,8", "2,4", "8,1"]


# ---------------------------------------------------------------------------
# One device: axis names, rules, meshes, the planner.

def test_param_logical_axes_cover_the_t5x_tree():
  assert family_of(get_config("t5_1_1_small")) is T5
  params = T5.abstract_params(get_config("t5_1_1_small"))
  axes = sharding.params_logical_axes(params, T5)
  assert axes["token_embedder"]["embedding"] == ("vocab", "embed")
  assert axes["decoder"]["logits_dense"]["kernel"] == ("embed", "vocab")
  layer = axes["decoder"]["layers_0"]
  assert layer["self_attention"]["query"]["kernel"] == ("embed", "joined_kv")
  assert layer["encoder_decoder_attention"]["out"]["kernel"] == ("joined_kv", "embed")
  assert layer["mlp"]["wi_1"]["kernel"] == ("embed", "mlp")
  assert layer["mlp"]["wo"]["kernel"] == ("mlp", "embed")
  assert layer["pre_mlp_layer_norm"]["scale"] == ("embed",)
  assert axes["encoder"]["relpos_bias"]["rel_embedding"] == ("heads", "relpos_buckets")
  # Original T5: single `wi`, tied logits.
  original = sharding.params_logical_axes(T5.abstract_params(get_config("t5_small")), T5)
  assert original["encoder"]["layers_0"]["mlp"]["wi"]["kernel"] == ("embed", "mlp")
  with pytest.raises(ValueError, match="no logical axes known for parameter 'foo/bar'"):
    sharding.params_logical_axes({"foo": {"bar": np.zeros(3)}}, T5)
  with pytest.raises(ValueError, match="expected a T5 cache"):
    T5.cache_logical_axes({"layers": []})


def test_rules_to_partition_specs():
  mesh = {"data": 2, "model": 4}
  rules = sharding.DEFAULT_RULES
  assert sharding.logical_to_spec(("embed", "joined_kv"), (32, 64), rules, mesh) == P(None, "model")
  # The T5 cache is head-major: [batch, heads, length, kv].
  assert sharding.logical_to_spec(t5_sharding.CACHE_KV_AXES, (8, 8, 12, 8), rules, mesh) == \
      P("data", "model")
  # A mesh axis is used once per array: the second 'heads' falls through to
  # the next rule naming it (none here), so it is replicated.
  assert sharding.logical_to_spec(("heads", "heads"), (8, 8), rules, mesh) == P("model")
  with pytest.raises(ValueError, match=r"dimension 0 \('vocab', size 30\) is not divisible by "
                     r"mesh axis model=4"):
    sharding.logical_to_spec(("vocab", "embed"), (30, 32), rules, mesh, "emb")
  with pytest.warns(UserWarning, match="Replicating"):
    spec = sharding.logical_to_spec(("vocab", "embed"), (30, 32), rules, mesh,
                                    on_indivisible="replicate")
  assert spec == P()
  with pytest.raises(ValueError, match="not in the mesh"):
    sharding.logical_to_spec(("vocab",), (32,), (("vocab", "tensor"),), mesh)


def test_mesh_shape_errors():
  assert sharding.parse_mesh_shape("2,4") == (2, 4)
  assert sharding.parse_mesh_shape("2x4") == (2, 4)
  for bad in ["2", "a,b", "0,4", "-1,-1", "2,4,1"]:
    with pytest.raises(ValueError, match="mesh_shape"):
      sharding.parse_mesh_shape(bad)
  devices = jax.devices()[:1]
  with pytest.raises(ValueError, match="does not divide the 1 available devices"):
    sharding.make_mesh("1,2", devices)


def test_gin_configures_the_partitioners():
  gin.clear_config()
  try:
    cwd = os.getcwd()
    os.chdir(REPO)  # gin includes are relative to the repository root.
    try:
      gin.parse_config_files_and_bindings(["configs/sharding/data_parallel.gin"], [])
    finally:
      os.chdir(cwd)
    target, draft = sharding.make_partitioners()
  finally:
    gin.clear_config()
  assert target.mesh_shape == {"data": jax.device_count(), "model": 1}
  assert target.rules == sharding.DEFAULT_RULES
  assert draft.rules == sharding.DRAFT_RULES and draft.mesh == target.mesh


def test_planner_for_xxl_shards_every_big_weight():
  xxl = get_config("t5_1_1_xxl")
  plan = memory.plan_memory(xxl, batch=1, context_len=512, max_decode_len=128,
                              mesh_shape="1,4", dtype="bfloat16")
  assert plan.params_bytes == xxl.num_params * 2
  # Only the norm scales (bf16 [4096] each) are replicated.
  replicated = (2 * 24 + 3 * 24 + 2) * 4096 * 2
  assert plan.params_bytes_per_device * 4 == plan.params_bytes + 3 * replicated
  # Cache: 24 layers x (self 128 + cross 512 positions) x K,V x heads*64, bf16; mask bools.
  assert plan.cache_bytes == 24 * 2 * (128 + 512) * 64 * 64 * 2 + 512
  assert plan.cache_bytes_per_device == (plan.cache_bytes - 512) // 4 + 512


def test_activation_axes_are_a_no_op_without_rules():
  x = np.ones((2, 3, 4), np.float32)
  assert t5._axes(x, ("batch", "length", "mlp")) is x


# ---------------------------------------------------------------------------
# Eight devices.

def _at(tree, key):
  for name in key:
    tree = tree[name]
  return tree


@pytest.mark.slow  # long: `make test-slow` (make test stays under 15 minutes)
def test_multidevice_in_subprocess():
  if MULTI:
    pytest.skip("already running with 8 devices")
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             # Cheaper CPU compiles; numerics are unchanged at this level.
             XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                       "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "multidevice",
       os.path.abspath(__file__)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
  summary = result.stdout.strip().splitlines()[-1]
  # Everything but this test itself ran.
  assert "1 skipped" in summary and "failed" not in summary, result.stdout[-2000:]


@pytest.fixture(scope="module")
def pair():
  target, draft = tiny_pair(noise=0.1, **TINY)
  tokens = random_encoder_tokens(BATCH, ENC_LEN, TINY["vocab_size"], seed=3)
  return target, draft, tokens


@pytest.fixture(scope="module")
def unsharded(pair):
  target, draft, tokens = pair
  greedy = generate(target, tokens, max_decode_steps=STEPS, draft=draft, gamma=GAMMA)
  sampled = generate(target, tokens, max_decode_steps=STEPS, draft=draft, gamma=GAMMA,
                     rng=jax.random.PRNGKey(7), **SAMPLING)
  return greedy, sampled


@pytest.fixture(scope="module")
def sharded_models(pair):
  target, draft, _ = pair
  out = {}
  for mesh_shape in MESHES:
    target_part, draft_part = sharding.make_partitioners(mesh_shape)
    out[mesh_shape] = (target_part, draft_part, loading.shard_model(target, target_part),
                       loading.shard_model(draft, draft_part))
  return out


@pytest.fixture(scope="module")
def sharded_caches(pair, sharded_models):
  """mesh -> (target cache, draft cache), allocated in their shardings."""
  _, _, tokens = pair
  return {mesh_shape: (sharding.init_sharded_cache(target, target_part, tokens, STEPS),
                       sharding.init_sharded_cache(draft, draft_part, tokens, STEPS))
          for mesh_shape, (target_part, draft_part, target, draft) in sharded_models.items()}


@multidevice
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_multidevice_params_and_cache_are_sharded(sharded_models, sharded_caches, mesh_shape):
  target_part, draft_part, target, draft = sharded_models[mesh_shape]
  cache, draft_cache = sharded_caches[mesh_shape]
  data, model = target_part.mesh_shape["data"], target_part.mesh_shape["model"]
  query = target.params["decoder"]["layers_0"]["self_attention"]["query"]["kernel"]
  assert query.sharding.spec == P(None, "model") and query.sharding.mesh == target_part.mesh
  assert {s.data.shape for s in query.addressable_shards} == {(32, 64 // model)}
  embedding = target.params["token_embedder"]["embedding"]
  assert {s.data.shape for s in embedding.addressable_shards} == {(64 // model, 32)}
  wo = target.params["encoder"]["layers_0"]["mlp"]["wo"]["kernel"]
  assert {s.data.shape for s in wo.addressable_shards} == {(64 // model, 32)}
  assert len(query.addressable_shards) == 8
  # The draft's weights are replicated (its default rules).
  draft_query = draft.params["decoder"]["layers_0"]["self_attention"]["query"]["kernel"]
  assert {s.data.shape for s in draft_query.addressable_shards} == {(32, 64)}

  key = cache["layers"][0]["self_key"]
  assert key.sharding.spec == P("data", "model")
  assert {s.data.shape for s in key.addressable_shards} == {(BATCH // data, 8 // model, STEPS, 8)}
  cross = cache["layers"][0]["cross_value"]
  assert {s.data.shape for s in cross.addressable_shards} == {
      (BATCH // data, 8 // model, ENC_LEN, 8)}
  assert {s.data.shape for s in draft_cache["layers"][0]["self_key"].addressable_shards} == {
      (BATCH // data, 8, STEPS, 8)}


@multidevice
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_multidevice_speculative_equals_unsharded(pair, unsharded, sharded_models, mesh_shape):
  _, _, tokens = pair
  greedy, sampled = unsharded
  target_part, draft_part, target, draft = sharded_models[mesh_shape]
  out = generate(target, tokens, max_decode_steps=STEPS, draft=draft, gamma=GAMMA,
                 partitioner=target_part, draft_partitioner=draft_part)
  assert out.sequences.sharding.mesh == target_part.mesh
  np.testing.assert_array_equal(out.sequences, greedy.sequences)
  np.testing.assert_array_equal(out.stats.accepted, greedy.stats.accepted)
  # The draft disagrees sometimes: both branches of the rejection rule ran.
  assert 0 < greedy.stats.acceptance_rate < 1
  out = generate(target, tokens, max_decode_steps=STEPS, draft=draft, gamma=GAMMA,
                 rng=jax.random.PRNGKey(7), partitioner=target_part,
                 draft_partitioner=draft_part, **SAMPLING)
  np.testing.assert_array_equal(out.sequences, sampled.sequences)


@multidevice
def test_multidevice_tree_equals_unsharded(pair, sharded_models):
  """A token tree under the mesh: its tree block, cache moves and draft state stay sharded."""
  target, draft, tokens = pair
  mesh_shape = MESHES[-1]
  target_part, draft_part, sharded_target, sharded_draft = sharded_models[mesh_shape]
  for kwargs in (dict(), dict(rng=jax.random.PRNGKey(7), **SAMPLING)):
    expected = generate(target, tokens, max_decode_steps=STEPS, block_width=8,
                        draft=sj_drafts.TreeDraft(draft, (2, 2)), **kwargs)
    out = generate(sharded_target, tokens, max_decode_steps=STEPS, block_width=8,
                   draft=sj_drafts.TreeDraft(sharded_draft, (2, 2)), partitioner=target_part,
                   draft_partitioner=draft_part, **kwargs)
    np.testing.assert_array_equal(out.sequences, expected.sequences)
    np.testing.assert_array_equal(out.stats.depth_histogram, expected.stats.depth_histogram)


@multidevice
def test_multidevice_prefix_attention_equals_unsharded(pair, sharded_models):
  """A cache longer than the CPU prefix-attention chunk: its per-layer loop over the
  written chunks, with the batch's max position reduced across the mesh."""
  from specdec_jax.families.t5 import decode as t5_decode
  target, _, tokens = pair
  target_part, _, sharded_target, _ = sharded_models["2,4"]
  steps = t5_decode.PREFIX_CHUNK + 20
  want = generate(target, tokens, max_decode_steps=steps, eos_id=-1)
  got = generate(sharded_target, tokens, max_decode_steps=steps, eos_id=-1,
                 partitioner=target_part)
  np.testing.assert_array_equal(got.sequences, want.sequences)


@multidevice
def test_multidevice_temperature_sample_equals_unsharded(pair, sharded_models):
  target, _, tokens = pair
  target_part, _, sharded_target, _ = sharded_models["2,4"]
  want = generate(target, tokens, max_decode_steps=STEPS, rng=jax.random.PRNGKey(3), **SAMPLING)
  got = generate(sharded_target, tokens, max_decode_steps=STEPS, rng=jax.random.PRNGKey(3),
                 partitioner=target_part, **SAMPLING)
  np.testing.assert_array_equal(got.sequences, want.sequences)
  # Unsharded params are laid out on the way in (a copy, but correct).
  got = generate(target, tokens, max_decode_steps=STEPS, rng=jax.random.PRNGKey(3),
                 partitioner=target_part, **SAMPLING)
  np.testing.assert_array_equal(got.sequences, want.sequences)


@multidevice
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_multidevice_planner_matches_allocated_bytes(sharded_models, sharded_caches, mesh_shape):
  target_part, draft_part, target, draft = sharded_models[mesh_shape]
  for model, part, cache in zip((target, draft), (target_part, draft_part),
                                sharded_caches[mesh_shape]):
    plan = memory.plan_memory(model.config, batch=BATCH, context_len=ENC_LEN,
                                max_decode_len=STEPS, mesh_shape=part.mesh_shape,
                                rules=part.rules)
    for device in target_part.mesh.devices.flat:
      assert memory.device_bytes(model.params, device) == plan.params_bytes_per_device
      assert memory.device_bytes(cache, device) == plan.cache_bytes_per_device
    assert plan.params_bytes == sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    assert plan.cache_bytes == sum(x.nbytes for x in jax.tree_util.tree_leaves(cache))


@multidevice
def test_multidevice_indivisible_replicate_mode_matches_planner(pair):
  target, _, _ = pair
  # 6 heads: joined_kv (48) divides model=4, rel_embedding's 6 heads do not.
  config = target.config.replace(num_heads=6)
  part, _ = sharding.make_partitioners("2,4", on_indivisible="replicate")
  host = jax.tree_util.tree_map(lambda s: np.ones(s.shape, s.dtype), T5.abstract_params(config))
  with pytest.warns(UserWarning, match="rel_embedding"):
    params = part.shard_params(host, T5)
  rel = params["decoder"]["relpos_bias"]["rel_embedding"]
  assert {s.data.shape for s in rel.addressable_shards} == {(6, 32)}
  with pytest.warns(UserWarning, match="rel_embedding"):
    plan = memory.plan_memory(config, batch=BATCH, context_len=ENC_LEN, max_decode_len=STEPS,
                                mesh_shape="2,4", on_indivisible="replicate")
  assert memory.device_bytes(params, jax.devices()[0]) == plan.params_bytes_per_device


@multidevice
def test_multidevice_bad_input_errors(pair):
  target, draft, tokens = pair
  with pytest.raises(ValueError, match="needs 3 devices, which does not divide the 8"):
    sharding.make_partitioners("3,1")
  with pytest.raises(ValueError, match="does not divide the 8 devices"):
    sharding.make_partitioners("3,-1")
  part, _ = sharding.make_partitioners("1,8")
  shapes = T5.abstract_params(target.config.replace(vocab_size=60))
  odd = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes)
  with pytest.raises(ValueError, match=r"params/.*: dimension \d \('vocab', size 60\) is not "
                     r"divisible by mesh axis model=8"):
    part.shard_params(odd, T5)
  part_2d, _ = sharding.make_partitioners("4,2")
  with pytest.raises(ValueError, match=r"inputs: dimension 0 \('batch', size 6\) is not "
                     r"divisible by mesh axis data=4"):
    generate(target, tokens[:6], max_decode_steps=STEPS, draft=draft, partitioner=part_2d)
  other_mesh, _ = sharding.make_partitioners("8,1")
  with pytest.raises(ValueError, match="share one mesh"):
    generate(target, tokens, max_decode_steps=STEPS, draft=draft, partitioner=part_2d,
             draft_partitioner=other_mesh)


@multidevice
def test_multidevice_activation_axes_constrain_under_jit():
  part, draft_part = sharding.make_partitioners("2,4")

  def named(partitioner):
    def f(x):
      with partitioner.activation_axes():
        return t5._axes(x * 2, ("batch", "length", "mlp"))
    x = jax.device_put(np.ones((8, 4, 16), np.float32), part.replicated())
    return jax.jit(f)(x).sharding.spec

  assert named(part) == P("data", None, "model")
  assert named(draft_part) == P("data")


@multidevice
def test_multidevice_checkpoint_loads_straight_into_shards(pair, tmp_path, record_placements):
  """A Hugging Face checkpoint lands sliced per device, with the same values."""
  target, _, _ = pair
  loading.export_hf(target, str(tmp_path / "hf"))
  target_part, _ = sharding.make_partitioners("2,4")

  placed = record_placements(T5)
  loaded = loading.load_sharded_model(str(tmp_path / "hf"), target_part, dtype="float32")
  expected = target_part.param_shardings(target.params, T5)
  # Every tensor landed in its final sharding as it was read, not re-placed afterwards.
  assert len(placed) == len(jax.tree_util.tree_leaves(target.params))
  for key, sharding_ in placed:
    assert sharding_ == _at(expected, key), key
  kernel = loaded.params["decoder"]["logits_dense"]["kernel"]
  assert kernel.sharding.spec == P(None, "model")
  assert {s.data.shape for s in kernel.addressable_shards} == {
      (kernel.shape[0], kernel.shape[1] // 4)}
  for got, want, sharding_ in zip(jax.tree_util.tree_leaves(loaded.params),
                                  jax.tree_util.tree_leaves(target.params),
                                  jax.tree_util.tree_leaves(expected)):
    assert got.sharding == sharding_
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

  # Random weights are initialised straight into their shardings.
  fresh = loading.load_sharded_model(target.config, target_part, seed=5)
  want = loading.load_model(target.config, seed=5)
  for got, ref, sharding_ in zip(jax.tree_util.tree_leaves(fresh.params),
                                 jax.tree_util.tree_leaves(want.params),
                                 jax.tree_util.tree_leaves(expected)):
    assert got.sharding == sharding_
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_per_host_helpers_on_one_process():
  """On one process the per-host helpers are the identity (the 2-process
  behaviour is tests/test_multihost.py's)."""
  part, _ = sharding.make_partitioners("1,-1")
  tokens = np.arange(12, dtype=np.int32).reshape(4, 3)
  lengths = np.array([3, 1, 2, 3], np.int32)
  got_tokens, got_lengths = multihost.global_batch(part, tokens, lengths)
  np.testing.assert_array_equal(np.asarray(got_tokens), tokens)
  np.testing.assert_array_equal(np.asarray(got_lengths), lengths)
  assert got_tokens.sharding == part.batch_sharding(tokens.shape)
  with pytest.raises(ValueError, match="same leading"):
    multihost.global_batch(part, tokens, lengths[:3])
  assert multihost.process_row_block(4) == slice(0, 4)
  assert multihost.process_row_block(4, 1) == slice(4, 8)
  assert multihost.blocks_match_devices(part.batch_sharding((4, 3)), (4, 3), 4)
  assert not multihost.blocks_match_devices(part.batch_sharding((4, 3)), (4, 3), 2)
  rows = multihost.gather_ragged([[1, 2, 3], [], [4]])
  assert [r.tolist() for r in rows] == [[1, 2, 3], [], [4]]
  assert multihost.gather_texts(["héllo", ""]) == ["héllo", ""]
  assert multihost.on_every_process(lambda: 7, "x") == 7
  with pytest.raises(KeyError):
    multihost.on_every_process(lambda: {}["absent"], "x")
