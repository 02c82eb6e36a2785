"""Mixture-of-experts layouts (`MixtralForCausalLM`, `Qwen3MoeForCausalLM`) against transformers.

Tiny random transformers models (vocab 101), saved with save_pretrained (transformers 5
writes the hub's per-expert names) and loaded through `specdec_jax.load_model`:

* Mixtral: 4 experts, top 2 renormalised, a sliding window of 5 (smaller than the
  prompts), head_dim != hidden / heads.
* Qwen3-MoE: q/k norms, 8 experts of 24 units, top 3 *not* renormalised (transformers'
  default), layer 1 a dense MLP of 64 units (mlp_only_layers); a second config with
  norm_topk_prob and decoder_sparse_step 2 for the logits only.

Checked: logits within 1e-5 of transformers in float32, teacher-forced under each
dispatch ('dense', 'gather', 'auto') and from the prefill of right-padded prompts of
mixed lengths; greedy generation token for token vs transformers' `generate`;
speculative greedy with a smaller draft of the same layout (the target's first layer)
equal to target-only in float32 and bit for bit in bfloat16 (one bf16 run per dispatch
path); export round trip, transformers 5's fused expert tensors, widening, sharding axes;
bad checkpoints and configs; the named shapes (Mixtral-8x7B, Qwen3-30B-A3B) planned
without allocation.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import assert_matches_rows, hf_greedy, hf_logits, ragged_prompts

import specdec_jax as sj
from specdec_jax import memory, sharding
from specdec_jax.families.decoder_only import checkpoints as cdo
from specdec_jax.families.decoder_only.config import (DECODER_CONFIGS, DecoderOnlyConfig,
                                                      get_decoder_config)
from specdec_jax.families.decoder_only.model import DecoderOnlyModel
from specdec_jax.families.registry import family_of
from specdec_jax.families.tensor_io import CheckpointError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 101
EOS = 2
LENGTHS = [3, 9, 6, 12]  # Mixed prompt lengths, right-padded to 12.
STEPS = 10
TOL = 1e-5
WINDOW = 5  # Mixtral's sliding window: smaller than every prompt but the first.

_COMMON = dict(vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=1, eos_token_id=EOS,
               pad_token_id=0, hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16)
LAYOUTS = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(_COMMON, num_hidden_layers=2, intermediate_size=40, num_local_experts=4,
                     num_experts_per_tok=2, sliding_window=WINDOW)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(_COMMON, num_hidden_layers=3, intermediate_size=64,
                       moe_intermediate_size=24, num_experts=8, num_experts_per_tok=3,
                       norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe_sparse_step": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                              dict(_COMMON, num_hidden_layers=4, intermediate_size=56,
                                   moe_intermediate_size=20, num_experts=6,
                                   num_experts_per_tok=2, norm_topk_prob=True,
                                   decoder_sparse_step=2, tie_word_embeddings=True)),
}


def _randomise(model, seed):
  """Every parameter random: HF's init (normal(0.02), unit norms) gives near-uniform
  logits and routers, which would hide a wrong routing or a wrong norm."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = torch.randn_like(param)
      if name.endswith(("q_norm.weight", "k_norm.weight")):
        param.copy_(1.0 + 0.5 * noise)
      elif "norm" in name:
        param.copy_(1.0 + 0.2 * noise)
      elif name.endswith("gate.weight"):  # The routers: decisive, far from ties.
        param.copy_(0.5 * noise)
      else:
        param.copy_((0.1 if name.endswith(("embed_tokens.weight", "lm_head.weight")) else 0.15)
                    * noise)
  return model


def _hf_model(layout):
  config_class, model_class, fields = LAYOUTS[layout]
  return _randomise(model_class(config_class(**fields)).eval(), sorted(LAYOUTS).index(layout))


def _first_layer(hf, layout):
  """The target cut to its first layer, as its own model of the same class."""
  config_class, model_class, _ = LAYOUTS[layout]
  fields = hf.config.to_dict()
  fields["num_hidden_layers"] = 1
  fields.pop("layer_types", None)
  if "mlp_only_layers" in fields:
    fields["mlp_only_layers"] = [i for i in fields["mlp_only_layers"] if i < 1]
  small = model_class(config_class(**fields)).eval()
  state = {k: v for k, v in hf.state_dict().items()
           if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
  small.load_state_dict(state, strict=True)
  return small


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
  """layout -> dict(hf, model (float32), directory, draft_directory)."""
  cache = {}

  def get(layout):
    if layout not in cache:
      hf = _hf_model(layout)
      directory = str(tmp_path_factory.mktemp(layout))
      hf.save_pretrained(directory)
      entry = dict(hf=hf, model=sj.load_model(directory, dtype="float32"), directory=directory)
      if layout != "qwen3_moe_sparse_step":
        entry["draft_directory"] = str(tmp_path_factory.mktemp(layout + "_draft"))
        _first_layer(hf, layout).save_pretrained(entry["draft_directory"])
      cache[layout] = entry
    return cache[layout]

  return get


def _prompts(lengths, seed):
  return ragged_prompts(lengths, seed, VOCAB)


def _with(model, **fields):
  return DecoderOnlyModel(model.config.replace(**fields), model.params)


# ---------------------------------------------------------------------------
# Parity with transformers.

@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logits_match_transformers(layout, pairs):
  pair = pairs(layout)
  hf, model = pair["hf"], pair["model"]
  cfg, fields = model.config, LAYOUTS[layout][2]
  experts = fields.get("num_local_experts", fields.get("num_experts"))
  assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok) == (
      layout.split("_sparse")[0], experts, fields["num_experts_per_tok"])
  assert cfg.num_params == sum(p.numel() for p in hf.parameters())
  assert sum(x.size for x in jax.tree_util.tree_leaves(model.params)) == cfg.num_params
  if layout == "mixtral":
    assert (cfg.sliding_window, cfg.moe_layers, cfg.norm_topk_prob) == (WINDOW, (True,) * 2, True)
  elif layout == "qwen3_moe":
    assert (cfg.moe_layers, cfg.expert_mlp_dim, cfg.mlp_dim, cfg.norm_topk_prob, cfg.qk_norm) == (
        (True, False, True), 24, 64, False, True)
    assert model.params["layers_1"]["mlp"]["gate_proj"]["kernel"].shape == (48, 64)
  else:
    assert cfg.moe_layers == (False, True, False, True) and cfg.tie_word_embeddings

  # Teacher-forced full rows (20 tokens: past Mixtral's window), every dispatch.
  tokens = _prompts([20, 20, 20], seed=1)
  want = hf_logits(hf, tokens)
  assert np.abs(want).max() > 1.0, "near-zero logits would prove nothing"
  for dispatch in ("dense", "gather", "auto"):
    got = np.asarray(_with(model, moe_dispatch=dispatch).logits(tokens))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0, err_msg=dispatch)

  # Right-padded prompts of mixed lengths: the prefill's logits at each row's last prompt
  # token, and the teacher-forced logits of each row's real tokens, equal transformers'
  # on the unpadded row.
  prompts = _prompts(LENGTHS, seed=2)
  last, _ = model.prefill(prompts, np.array(LENGTHS, np.int32),
                          model.init_cache(len(LENGTHS), prompts.shape[1]))
  padded = np.asarray(model.logits(prompts))
  for b, n in enumerate(LENGTHS):
    row = hf_logits(hf, prompts[b:b + 1, :n])[0]
    np.testing.assert_allclose(np.asarray(last)[b], row[-1], atol=TOL, rtol=0)
    np.testing.assert_allclose(padded[b, :n], row, atol=TOL, rtol=0)

  # The routing shapes these logits: another k, or the other renormalisation, is far off.
  other = dict(num_experts_per_tok=1) if layout == "mixtral" else dict(
      norm_topk_prob=not cfg.norm_topk_prob)
  assert np.abs(np.asarray(_with(model, **other).logits(tokens)) - want).max() > 0.1


@pytest.mark.parametrize("layout", ["mixtral", "qwen3_moe"])
def test_greedy_and_speculative_match_transformers(layout, pairs):
  """Target-only greedy == HF generate per row (ragged prompts, prompt_lengths);
  speculative greedy with the one-layer draft == target-only (float32)."""
  pair = pairs(layout)
  hf, model = pair["hf"], pair["model"]
  prompts = _prompts(LENGTHS, seed=3)
  want = hf_greedy(hf, prompts, LENGTHS, STEPS, EOS)
  assert any(len(set(w)) >= 5 for w in want), f"degenerate outputs prove nothing: {want}"
  target = sj.generate(model, prompts, LENGTHS, max_decode_steps=STEPS)
  assert_matches_rows(target.sequences, want)

  small = sj.load_model(pair["draft_directory"], dtype="float32")
  assert (small.config.family, small.config.num_layers) == (model.config.family, 1)
  spec = sj.generate(model, prompts, LENGTHS, max_decode_steps=STEPS, draft=sj.ModelDraft(small),
                     gamma=3)
  np.testing.assert_array_equal(np.asarray(spec.sequences), np.asarray(target.sequences))
  assert 0 < spec.stats.acceptance_rate < 1, "the one-layer draft should be partly right"


@pytest.mark.parametrize("layout,dispatch", [("mixtral", "auto"), ("qwen3_moe", "gather")])
def test_bfloat16_speculative_is_bit_identical_to_target_only(layout, dispatch, pairs):
  """bf16 weights and compute, block width 8 in both loops (the default off CPU float32):
  Mixtral through 'auto' (= dense at 4 rows x 8 tokens), Qwen3-MoE through 'gather'. Each
  token's MoE output depends on its own row only, so the junk of rejected drafts beside
  it cannot change a bit of it."""
  pair = pairs(layout)
  model = _with(sj.load_model(pair["directory"], dtype="bfloat16"), moe_dispatch=dispatch)
  small = sj.load_model(pair["draft_directory"], dtype="bfloat16")
  assert {x.dtype for x in jax.tree_util.tree_leaves(model.params)} == {jnp.dtype("bfloat16")}
  prompts = _prompts(LENGTHS, seed=4)
  want = sj.generate(model, prompts, LENGTHS, max_decode_steps=STEPS, eos_id=-1)
  got = sj.generate(model, prompts, LENGTHS, max_decode_steps=STEPS, eos_id=-1,
                    draft=sj.ModelDraft(small), gamma=3)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  assert 0 < got.stats.acceptance_rate < 1
  assert len(set(np.asarray(want.sequences).ravel().tolist())) >= 8


# ---------------------------------------------------------------------------
# Checkpoint formats, export, widening, sharding.

def _fused(directory, out, family):
  """The checkpoint rewritten in transformers 5's in-memory form: experts fused into
  gate_up_proj [E, 2 * mlp, emb] (gate rows first) and down_proj [E, emb, mlp]; Mixtral's
  block_sparse_moe renamed mlp."""
  state = safetensors_torch.load_file(os.path.join(directory, "model.safetensors"))
  linears = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
  fused, groups = {}, {}
  for name, tensor in state.items():
    name = name.replace(".block_sparse_moe.", ".mlp.")
    parts = name.split(".experts.")
    if len(parts) == 1:
      fused[name] = tensor
      continue
    expert, linear = parts[1].split(".")[:2]
    groups.setdefault(parts[0], {}).setdefault(linear, {})[int(expert)] = tensor
  for prefix, by_linear in groups.items():
    stack = lambda linear: torch.stack([by_linear[linear][e]  # noqa: E731
                                        for e in sorted(by_linear[linear])])
    fused[f"{prefix}.experts.gate_up_proj"] = torch.cat([stack(linears[0]), stack(linears[1])], 1)
    fused[f"{prefix}.experts.down_proj"] = stack(linears[2])
  os.makedirs(out)
  safetensors_torch.save_file(fused, os.path.join(out, "model.safetensors"))
  with open(os.path.join(directory, "config.json")) as f:
    config = f.read()
  with open(os.path.join(out, "config.json"), "w") as f:
    f.write(config)


@pytest.mark.parametrize("layout", ["mixtral", "qwen3_moe"])
def test_fused_experts_export_round_trip_and_widening(layout, pairs, tmp_path):
  pair = pairs(layout)
  model = pair["model"]
  tokens = _prompts([16, 16], seed=6)
  want = np.asarray(model.logits(tokens))

  # transformers 5's fused expert tensors (transformers itself reads this directory back to
  # the same function) load to the same params.
  _fused(pair["directory"], str(tmp_path / "fused"), model.config.family)
  hf_fused = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fused").eval()
  np.testing.assert_array_equal(hf_logits(hf_fused, tokens), hf_logits(pair["hf"], tokens))
  fused = sj.load_model(str(tmp_path / "fused"), dtype="float32")
  for a, b in zip(jax.tree_util.tree_leaves(fused.params),
                  jax.tree_util.tree_leaves(model.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # Our model -> a directory transformers reproduces (per-expert names); we reload it exactly.
  cdo.export_hf_decoder_only(model, tmp_path / "export")
  with open(tmp_path / "export" / "config.json") as f:
    assert json.load(f)["architectures"] == [type(pair["hf"]).__name__]
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
  assert type(hf) is type(pair["hf"])
  np.testing.assert_allclose(want, hf_logits(hf, tokens), atol=TOL, rtol=0)
  again = sj.load_model(str(tmp_path / "export"), dtype="float32")
  assert again.config == model.config
  for a, b in zip(jax.tree_util.tree_leaves(again.params), jax.tree_util.tree_leaves(model.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # Widening keeps the function: experts grow like MLPs, the router reads first copies; the
  # new layer (a MoE layer, routed to zero experts) adds nothing.
  cfg = model.config
  grown = dict(emb_dim=2 * cfg.emb_dim, num_heads=8, num_kv_heads=4, mlp_dim=cfg.mlp_dim + 8,
               num_layers=cfg.num_layers + 1)
  if cfg.moe_mlp_dim is not None:
    grown["moe_mlp_dim"] = cfg.moe_mlp_dim + 8
  large = sj.embed_model(model, cfg.replace(**grown))
  assert large.config.moe_layers[-1]
  np.testing.assert_allclose(np.asarray(large.logits(tokens)), want, atol=TOL, rtol=0)
  with pytest.raises(sj.EmbeddingError, match="num_experts differs"):
    sj.embed_model(model, cfg.replace(**grown, num_experts=cfg.num_experts + 1))


def test_sharding_axes_and_expert_parallel_rule():
  cfg = DECODER_CONFIGS["qwen3_30b_a3b"]
  family = family_of(cfg)
  axes = family.param_logical_axes
  assert axes(("layers_0", "mlp", "experts", "gate_proj"), 3) == ("expert", "embed", "mlp")
  assert axes(("layers_0", "mlp", "experts", "down_proj"), 3) == ("expert", "mlp", "embed")
  assert axes(("layers_0", "mlp", "gate", "kernel"), 2) == ("embed", "expert")
  params = family.abstract_params(cfg)
  logical = sharding.params_logical_axes(params, family)
  gate = params["layers_0"]["mlp"]["experts"]["gate_proj"]
  down = params["layers_0"]["mlp"]["experts"]["down_proj"]
  mesh = {"data": 1, "model": 8}
  rules = sharding.normalize_rules(sharding.DEFAULT_RULES)
  # Default rules: experts replicated along `expert`, split along their units.
  spec = lambda x, a, r: sharding.logical_to_spec(a, x.shape, r, mesh)  # noqa: E731
  assert spec(gate, logical["layers_0"]["mlp"]["experts"]["gate_proj"], rules) == (
      sharding.PartitionSpec(None, None, "model"))
  assert spec(down, logical["layers_0"]["mlp"]["experts"]["down_proj"], rules) == (
      sharding.PartitionSpec(None, "model"))
  # One rule in front gives expert parallelism (units then whole).
  ep = sharding.normalize_rules((("expert", "model"),) + sharding.DEFAULT_RULES)
  assert spec(gate, logical["layers_0"]["mlp"]["experts"]["gate_proj"], ep) == (
      sharding.PartitionSpec("model"))


def test_router_ties_go_to_the_lower_expert_index():
  """A zero router ties every expert: the top k are experts 0..k-1 (jax.lax.top_k's
  documented rule; transformers takes what torch.topk's selection returns), each weighted
  1/k after renormalisation, under both dispatches; without renormalisation 1/E each."""
  from specdec_jax.families.decoder_only.network import MoeMlp
  cfg = get_decoder_config("qwen3_moe_tiny")  # 8 experts, top 3.
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, cfg.emb_dim))
  params = MoeMlp(cfg).init(jax.random.PRNGKey(1), x)["params"]
  params = dict(params, gate={"kernel": jnp.zeros_like(params["gate"]["kernel"])})
  w = {k: np.asarray(v, np.float64) for k, v in params["experts"].items()}
  silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
  outs = [(silu(np.asarray(x, np.float64) @ w["gate_proj"][e]) *
           (np.asarray(x, np.float64) @ w["up_proj"][e])) @ w["down_proj"][e]
          for e in range(cfg.num_experts)]
  for norm, weight in ((True, 1 / 3), (False, 1 / 8)):
    want = weight * sum(outs[:3])
    for dispatch in ("dense", "gather"):
      got = MoeMlp(cfg.replace(norm_topk_prob=norm, moe_dispatch=dispatch)).apply(
          {"params": params}, x)
      np.testing.assert_allclose(np.asarray(got), want, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------------------
# Bad input.

def test_bad_checkpoints_and_configs(pairs, tmp_path):
  pair = pairs("mixtral")
  directory = pair["directory"]
  state = safetensors_torch.load_file(os.path.join(directory, "model.safetensors"))
  with open(os.path.join(directory, "config.json")) as f:
    config = json.load(f)

  def write(name, tensors, **changes):
    out = tmp_path / name
    out.mkdir()
    safetensors_torch.save_file(tensors, str(out / "model.safetensors"))
    with open(out / "config.json", "w") as f:
      json.dump(dict(config, **changes), f)
    return str(out)

  # One expert tensor missing: named, with the param it belongs to.
  gone = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
  bad = write("missing", {k: v for k, v in state.items() if k != gone})
  with pytest.raises(CheckpointError, match=r"missing \(1\):\n.*experts\.2\.w3\.weight "
                     r"\(expert 2 of layers_1/mlp/experts/up_proj\)"):
    sj.load_model(bad, dtype="float32")
  # Every expert of a projection missing: the per-expert range and the fused name.
  bad = write("missing_all", {k: v for k, v in state.items() if ".w2." not in k or
                              ".layers.0." in k})
  with pytest.raises(CheckpointError, match=r"experts\.0\.w2\.weight \.\. .*experts\.3\.w2\.weight"
                     r", or the fused .*experts\.down_proj"):
    sj.load_model(bad, dtype="float32")
  # A mis-shaped expert is named as such.
  shaped = dict(state)
  shaped["model.layers.0.block_sparse_moe.experts.1.w1.weight"] = torch.zeros(41, 48)
  with pytest.raises(CheckpointError, match=r"experts\.1\.w1\.weight: checkpoint \(41, 48\) vs "
                     r"expected \(40, 48\) \(expert 1 of layers_0/mlp/experts/gate_proj\)"):
    sj.load_model(write("shape", shaped), dtype="float32")
  # k above the expert count, from config.json and from a config.
  bad = write("topk", state, num_experts_per_tok=5)
  with pytest.raises(CheckpointError, match=r"num_experts_per_tok must be an int between 1 and "
                     r"num_experts \(4\), got 5"):
    sj.load_model(bad, dtype="float32")
  with pytest.raises(ValueError, match=r"num_experts_per_tok .* num_experts \(8\), got 9"):
    get_decoder_config("qwen3_moe_tiny", num_experts_per_tok=9)
  with pytest.raises(ValueError, match="mixture-of-experts MLPs need a MoE family"):
    get_decoder_config("llama_tiny", num_experts=4)
  with pytest.raises(ValueError, match="mlp_only_layers entries must be layer indices"):
    get_decoder_config("qwen3_moe_tiny", mlp_only_layers=(3,))
  with pytest.raises(ValueError, match="moe_dispatch must be one of"):
    get_decoder_config("mixtral_tiny", moe_dispatch="sorted")
  # What Mixtral's class cannot say is refused at export.
  with pytest.raises(ValueError, match="MixtralForCausalLM has a mixture of experts"):
    cdo.decoder_config_to_hf_config(pair["model"].config.replace(norm_topk_prob=False))


# ---------------------------------------------------------------------------
# Named shapes and hub config.json files.

# mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B config.json, abridged.
_HUB_CONFIGS = {
    "mixtral_8x7b": {
        "architectures": ["MixtralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05,
        "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": None,
        "tie_word_embeddings": False, "vocab_size": 32000},
    "qwen3_30b_a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
        "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936},
}


def test_named_shapes_hub_configs_and_memory_plan():
  # Total parameters (the hubs' safetensors metadata: 46.7B, 30.5B).
  assert DECODER_CONFIGS["mixtral_8x7b"].num_params == 46_702_792_704
  assert DECODER_CONFIGS["qwen3_30b_a3b"].num_params == 30_532_122_624
  assert get_decoder_config("qwen3-30b-a3b") is DECODER_CONFIGS["qwen3_30b_a3b"]
  for name, hub in _HUB_CONFIGS.items():
    parsed = cdo.hf_config_to_decoder_config(hub)
    named = get_decoder_config(name, dtype="float32")
    for field in dataclasses.fields(named):
      if field.name != "pad_id":  # Not in the hub files; it only fills prompt padding.
        assert getattr(parsed, field.name) == getattr(named, field.name), (name, field.name)
  for name, layers, kv in (("mixtral_8x7b", 32, 8), ("qwen3_30b_a3b", 48, 4)):
    config = DECODER_CONFIGS[name]
    # Planned from shapes alone (46.7B bf16 params are not allocated), on one device and
    # with the experts' units over a 4-way model axis.
    plan = sj.plan_memory(config, batch=2, context_len=512, max_decode_len=128,
                          mesh_shape="1,1", dtype="bfloat16")
    assert plan.params_bytes == plan.params_bytes_per_device == 2 * config.num_params
    assert plan.cache_bytes == 2 * layers * 2 * (512 + 127) * kv * 128 * 2
    split = memory.plan_memory(config, batch=2, context_len=512, max_decode_len=128,
                               mesh_shape="1,4", dtype="bfloat16")
    assert split.params_bytes_per_device < 0.26 * split.params_bytes, name
  # The tiny named configs (both built in test_decoder_only's per-config test) give random
  # weights through the public entry: the one with a dense layer between MoE layers.
  tiny = sj.load_model("qwen3_moe_tiny", seed=0, dtype="float32")
  assert isinstance(tiny.config, DecoderOnlyConfig) and tiny.config.moe_layers == (
      True, False, True)
  assert np.isfinite(np.asarray(tiny.logits(_prompts([5], seed=5)))).all()
