"""Every gin file in configs/ parses; every model-size file builds its shapes."""

import glob
import os

import gin
import jax
import jax.numpy as jnp
import pytest

from experiments import run as run_lib
from experiments.paper_tables import TABLE2
from specdec_jax.families.t5.config import CONFIGS, T5Config
from specdec_jax.families.t5.network import T5

ROOT = run_lib.REPO_ROOT
# Directories other engineers own, with configurables from their modules.
# configs/t5x/ is T5X's gin (dynamic registration, imports t5x): parsed by
# tests/test_t5x_integration.py where T5X is importable.
OTHER_OWNERS = ("train", "demo_pair", "sharding", "t5x")
GIN_FILES = sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "**", "*.gin"),
                                                recursive=True)
    if os.path.relpath(p, os.path.join(ROOT, "configs")).split(os.sep)[0] not in OTHER_OWNERS)
MODEL_FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "models", "*.gin")))


def _configurable_t5config():
  return gin.get_configurable(T5Config)


@pytest.mark.parametrize("path", GIN_FILES)
def test_gin_file_parses(path):
  run_lib.parse_gin([path], [])
  gin.clear_config()


def test_every_named_config_has_a_model_file():
  names = {os.path.basename(p)[:-4] for p in MODEL_FILES}
  assert names == set(CONFIGS)


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: os.path.basename(p)[:-4])
def test_model_file_builds_shapes(path):
  name = os.path.basename(path)[:-4]
  run_lib.parse_gin([path], [])
  with gin.config_scope(name):
    config = _configurable_t5config()()
  gin.clear_config()
  assert config == CONFIGS[name]
  dummy = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  shapes = jax.eval_shape(lambda t: T5(config).init(jax.random.PRNGKey(0), t, t), dummy)
  count = sum(x.size for x in jax.tree_util.tree_leaves(shapes))
  assert count == config.num_params
  assert shapes["params"]["token_embedder"]["embedding"].shape == (config.vocab_size,
                                                                    config.emb_dim)


@pytest.mark.parametrize("row", TABLE2, ids=lambda r: r.name)
def test_table2_files_set_the_papers_settings(row):
  run_lib.parse_gin([f"configs/table2/{row.name}.gin"], [])
  try:
    assert gin.query_parameter("%GAMMA") == row.gamma
    assert gin.query_parameter("%TEMPERATURE") == row.temperature
    prefix = gin.query_parameter("Task.prefix")
    assert prefix == {"ende": "translate English to German: ", "cnndm": "summarize: "}[row.task]
    assert gin.query_parameter("draft/ModelSpec.name") == row.draft
  finally:
    gin.clear_config()


@pytest.mark.parametrize("pair,target,draft", [
    ("t5_1_1_xxl__small", "t5_1_1_xxl", "t5_1_1_small"),
    ("t5_1_1_xxl__base", "t5_1_1_xxl", "t5_1_1_base"),
    ("t5_1_1_xxl__large", "t5_1_1_xxl", "t5_1_1_large"),
    ("flan_t5_xxl__small", "flan_t5_xxl", "flan_t5_small"),
    ("tiny_demo", "tiny", None)])
def test_pair_files_build_their_specs(pair, target, draft):
  run_lib.parse_gin([f"configs/pairs/{pair}.gin"],
                    ["TARGET_CHECKPOINT = '/t'", "DRAFT_CHECKPOINT = '/d'"])
  try:
    with gin.config_scope("target"):
      target_spec = run_lib.ModelSpec()
    with gin.config_scope("draft"):
      draft_spec = run_lib.ModelSpec()
  finally:
    gin.clear_config()
  assert target_spec.config == CONFIGS[target]
  if draft is None:
    assert draft_spec.config is None and draft_spec.perturb_target == 0.1
  else:
    assert draft_spec.config == CONFIGS[draft]
    assert (target_spec.checkpoint, draft_spec.checkpoint) == ("/t", "/d")
