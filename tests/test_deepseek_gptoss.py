"""DeepSeek-V3 and gpt-oss layouts (`DeepseekV3ForCausalLM`, `GptOssForCausalLM`) against
transformers.

Tiny random transformers models (vocab 101), saved with save_pretrained and loaded through
`specdec_jax.load_model`:

* DeepSeek-V3: latent attention with a q LoRA (24), a 16-wide latent, 16 + 8 query/key
  dims per head and 12-wide values, interleaved rotary pairs, YaRN x4 from 32 positions
  with mscale = mscale_all_dim = 1 (the softmax scale grows by mscale^2); layer 0 dense,
  layer 1 MoE: 8 experts in 4 groups (the best 2 kept), top 3 by sigmoid + a random
  e_score_correction_bias, renormalised, x2.5, plus a shared expert. A second config
  (logits only): a plain q_proj, attention biases, no rope interleave, default rope, two
  shared experts, no dense layer, norm_topk_prob off, one group.
* gpt-oss: q/k/v/o biases, random attention sinks, a window of 4 (smaller than the
  prompts) on layer 0 and full attention on layer 1, YaRN x32 (GptOssConfig's default:
  not truncated, attention factor 1 + 0.1 ln 32), 4 experts top 2 with biases and the
  clamped SwiGLU (limit 7; the random weights drive pre-activations past it).

Checked: logits within 1e-5 of transformers in float32, teacher-forced under each dispatch
and from the prefill of right-padded prompts of mixed lengths, and that each feature moves
them (sinks, window, correction bias, groups, yarn factors, clamp); greedy generation token
for token vs transformers' `generate`; speculative greedy with a one-layer draft of the same
layout equal to target-only in float32 and bit for bit in bfloat16; export round trip
(transformers reproduces our export), DeepSeek's fused expert tensors, widening; the named
shapes (DeepSeek-V3 671B, gpt-oss-20b) planned without allocation and against the hub
config.json files; clear errors.
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
from specdec_jax.families.decoder_only import checkpoints as cdo
from specdec_jax.families.decoder_only.config import DECODER_CONFIGS, get_decoder_config
from specdec_jax.families.decoder_only.model import DecoderOnlyModel
from specdec_jax.families.decoder_only.network import rotary_inv_freq
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
WINDOW = 4  # gpt-oss's sliding window: smaller than every prompt but the first.

_COMMON = dict(vocab_size=VOCAB, max_position_embeddings=128, bos_token_id=1, eos_token_id=EOS,
               pad_token_id=0, hidden_size=48)
_DEEPSEEK = dict(_COMMON, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                 n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
                 qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4,
                 topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
                 rope_scaling=dict(rope_type="yarn", factor=4.0,
                                   original_max_position_embeddings=32, beta_fast=32,
                                   beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
LAYOUTS = {
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, _DEEPSEEK),
    "deepseek_v3_plain": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                          dict(_DEEPSEEK, q_lora_rank=None, attention_bias=True,
                               rope_interleave=False, rope_scaling=None, n_shared_experts=2,
                               first_k_dense_replace=0, norm_topk_prob=False, n_group=1,
                               topk_group=1)),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM,
                dict(_COMMON, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_local_experts=4,
                     num_experts_per_tok=2, sliding_window=WINDOW)),
}


def _randomise(model, seed):
  """Every parameter random (HF's init gives near-uniform logits and routers, which would
  hide a wrong routing or norm), and DeepSeek's correction bias (a buffer) too."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = torch.randn_like(param)
      if "norm" in name:
        param.copy_(1.0 + 0.2 * noise)
      elif name.endswith(("gate.weight", "router.weight")):  # Decisive routers.
        param.copy_(0.5 * noise)
      elif name.endswith("sinks"):  # Comparable to the scores: they take a real share.
        param.copy_(1.0 + noise)
      elif ".experts." in name and "gpt_oss" in type(model).__module__:
        param.copy_(0.6 * noise)  # Pre-activations past the clamp limit of 7.
      else:
        param.copy_((0.1 if name.endswith(("embed_tokens.weight", "lm_head.weight")) else 0.15)
                    * noise)
    for name, buffer in model.named_buffers():
      if name.endswith("e_score_correction_bias"):  # Changes the choice, not the weights.
        buffer.copy_(0.3 * torch.randn_like(buffer))
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
      if layout != "deepseek_v3_plain":
        entry["draft_directory"] = str(tmp_path_factory.mktemp(layout + "_draft"))
        _first_layer(hf, layout).save_pretrained(entry["draft_directory"])
      cache[layout] = entry
    return cache[layout]

  return get


def _prompts(lengths, seed):
  return ragged_prompts(lengths, seed, VOCAB)


def _with(model, **fields):
  return DecoderOnlyModel(model.config.replace(**fields), model.params)


def _with_params(model, edit):
  """The model with edit(flat params dict) applied to a copy of its params."""
  flat = {k: v for k, v in jax.tree_util.tree_flatten_with_path(model.params)[0]}
  flat = dict(flat)
  edit(flat)
  leaves = [flat[k] for k, _ in jax.tree_util.tree_flatten_with_path(model.params)[0]]
  return DecoderOnlyModel(model.config, jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(model.params), leaves))


def _zero_leaves(name):
  def edit(flat):
    for key in flat:
      if any(getattr(k, "key", None) == name for k in key):
        flat[key] = jnp.zeros_like(flat[key])
  return edit


# ---------------------------------------------------------------------------
# Parity with transformers.

@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logits_match_transformers(layout, pairs):
  pair = pairs(layout)
  hf, model = pair["hf"], pair["model"]
  cfg = model.config
  hf_count = sum(p.numel() for p in hf.parameters()) + sum(
      b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
  assert cfg.num_params == hf_count
  assert sum(x.size for x in jax.tree_util.tree_leaves(model.params)) == cfg.num_params
  if layout == "deepseek_v3":
    assert (cfg.family, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.head_dim, cfg.v_head_dim,
            cfg.rope_interleave, cfg.rope_scaling, cfg.moe_layers, cfg.n_shared_experts) == (
                "deepseek_v3", 24, 16, 24, 12, True, "yarn", (False, True), 1)
    # mscale = mscale_all_dim: cos/sin unscaled, the softmax scale times (1 + 0.1 ln 4)^2.
    assert cfg.yarn_attention_factor == 1.0
    np.testing.assert_allclose(cfg.attention_scale, 24 ** -0.5 * (1 + 0.1 * np.log(4)) ** 2)
  elif layout == "deepseek_v3_plain":
    assert (cfg.q_lora_rank, cfg.qkv_bias, cfg.out_bias, cfg.rope_interleave, cfg.rope_scaling,
            cfg.moe_layers, cfg.norm_topk_prob, cfg.n_group) == (
                None, True, True, False, None, (True, True), False, 1)
  else:
    assert (cfg.family, cfg.sliding_window, cfg.attention_types, cfg.rope_scaling,
            cfg.rope_truncate, cfg.swiglu_limit, cfg.qkv_bias, cfg.out_bias) == (
                "gpt_oss", WINDOW, ("sliding_attention", "full_attention"), "yarn", False, 7.0,
                True, True)
    np.testing.assert_allclose(cfg.yarn_attention_factor, 1 + 0.1 * np.log(32))
  # The rotary tables and scales are transformers' (YaRN's ramp, factors, mscale).
  rotary = hf.model.rotary_emb
  np.testing.assert_allclose(rotary_inv_freq(cfg), rotary.inv_freq.numpy(), rtol=1e-6)
  np.testing.assert_allclose(cfg.yarn_attention_factor, rotary.attention_scaling, rtol=1e-12)
  np.testing.assert_allclose(cfg.attention_scale, hf.model.layers[0].self_attn.scaling,
                             rtol=1e-12)

  # Teacher-forced full rows (20 tokens: past the window; 'auto' = dense at 60 tokens).
  tokens = _prompts([20, 20, 20], seed=1)
  want = hf_logits(hf, tokens)
  assert np.abs(want).max() > 1.0, "near-zero logits would prove nothing"
  np.testing.assert_allclose(np.asarray(model.logits(tokens)), want, atol=TOL, rtol=0)
  if layout == "deepseek_v3_plain":
    return

  # Right-padded prompts of mixed lengths through the 'gather' dispatch: the prefill's logits
  # at each row's last prompt token equal transformers' on the unpadded row.
  prompts = _prompts(LENGTHS, seed=2)
  gather = _with(model, moe_dispatch="gather")
  last, _ = gather.prefill(prompts, np.array(LENGTHS, np.int32),
                           gather.init_cache(len(LENGTHS), prompts.shape[1]))
  for b, n in enumerate(LENGTHS):
    row = hf_logits(hf, prompts[b:b + 1, :n])[0]
    np.testing.assert_allclose(np.asarray(last)[b], row[-1], atol=TOL, rtol=0)

  # Each feature shapes these logits (params zeroed: no recompilation; one config change).
  if layout == "deepseek_v3":
    changes = dict(correction=_with_params(model, _zero_leaves("e_score_correction_bias")),
                   shared=_with_params(model, _zero_leaves("shared_experts")),
                   groups=_with(model, topk_group=4))
    # YaRN's ramp moves some frequencies (truncated bounds), not all.
    plain = rotary_inv_freq(cfg.replace(rope_scaling=None))
    assert 0 < np.sum(~np.isclose(rotary_inv_freq(cfg), plain)) < len(plain)
  else:
    changes = dict(sinks=_with_params(model, _zero_leaves("sinks")),
                   window=_with(model, sliding_window=64))
    # Untruncated bounds differ from truncated ones; some pre-activations pass the clamp.
    assert not np.allclose(rotary_inv_freq(cfg), rotary_inv_freq(cfg.replace(rope_truncate=True)))
    experts = hf.model.layers[0].mlp.experts
    seen = []
    handle = experts.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    hf_logits(hf, tokens)
    handle.remove()
    gate_up = seen[0] @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (gate_up[:, 0::2] > cfg.swiglu_limit).any() and (
        gate_up[:, 1::2].abs() > cfg.swiglu_limit).any()
  for what, changed in changes.items():
    assert np.abs(np.asarray(changed.logits(tokens)) - want).max() > 1e-3, what


@pytest.mark.parametrize("layout", ["deepseek_v3", "gpt_oss"])
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


@pytest.mark.parametrize("layout,dispatch", [("deepseek_v3", "auto"), ("gpt_oss", "gather")])
def test_bfloat16_speculative_is_bit_identical_to_target_only(layout, dispatch, pairs):
  """bf16 weights and compute, block width 8 in both loops: each token's output depends on
  its own row only, so the junk of rejected drafts beside it cannot change a bit of it."""
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
# Export, fused experts, widening.

def _fused_deepseek(directory, out):
  """DeepSeek's experts rewritten in transformers 5's in-memory form: gate_up_proj
  [E, 2 * mlp, emb] (gate rows first) and down_proj [E, emb, mlp]."""
  state = safetensors_torch.load_file(os.path.join(directory, "model.safetensors"))
  fused, groups = {}, {}
  for name, tensor in state.items():
    parts = name.split(".experts.")
    if len(parts) == 1:
      fused[name] = tensor
      continue
    expert, linear = parts[1].split(".")[:2]
    groups.setdefault(parts[0], {}).setdefault(linear, {})[int(expert)] = tensor
  for prefix, by_linear in groups.items():
    stack = lambda linear: torch.stack([by_linear[linear][e]  # noqa: E731
                                        for e in sorted(by_linear[linear])])
    fused[f"{prefix}.experts.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], 1)
    fused[f"{prefix}.experts.down_proj"] = stack("down_proj")
  os.makedirs(out)
  safetensors_torch.save_file(fused, os.path.join(out, "model.safetensors"))
  with open(os.path.join(directory, "config.json")) as f:
    config = f.read()
  with open(os.path.join(out, "config.json"), "w") as f:
    f.write(config)


@pytest.mark.parametrize("layout", ["deepseek_v3", "gpt_oss"])
def test_export_round_trip_fused_experts_and_widening(layout, pairs, tmp_path):
  pair = pairs(layout)
  model = pair["model"]
  tokens = _prompts([16, 16], seed=6)
  want = np.asarray(model.logits(tokens))

  if layout == "deepseek_v3":  # The fused form loads to the same params.
    _fused_deepseek(pair["directory"], str(tmp_path / "fused"))
    fused = sj.load_model(str(tmp_path / "fused"), dtype="float32")
    for a, b in zip(jax.tree_util.tree_leaves(fused.params),
                    jax.tree_util.tree_leaves(model.params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # Our model -> a directory transformers reproduces; we reload it exactly.
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

  # Widening keeps the function: twice the width, twice the heads, wider experts, one more
  # (MoE) layer that adds nothing.
  cfg = model.config
  grown = dict(emb_dim=2 * cfg.emb_dim, num_heads=2 * cfg.num_heads,
               num_kv_heads=2 * cfg.num_kv_heads, mlp_dim=cfg.mlp_dim + 8,
               num_layers=cfg.num_layers + 1)
  if cfg.moe_mlp_dim is not None:
    grown["moe_mlp_dim"] = cfg.moe_mlp_dim + 8
  if cfg.layer_types is not None:
    grown["layer_types"] = cfg.layer_types + ("full_attention",)
  large = sj.embed_model(model, cfg.replace(**grown))
  assert large.config.moe_layers[-1]
  np.testing.assert_allclose(np.asarray(large.logits(tokens)), want, atol=TOL, rtol=0)


# ---------------------------------------------------------------------------
# Bad input.

def _write(tmp_path, name, state, config, **changes):
  out = tmp_path / name
  out.mkdir()
  safetensors_torch.save_file(state, str(out / "model.safetensors"))
  with open(out / "config.json", "w") as f:
    json.dump(dict(config, **changes), f)
  return str(out)


def test_bad_checkpoints_and_configs(pairs, tmp_path):
  for layout in ("deepseek_v3", "gpt_oss"):
    directory = pairs(layout)["directory"]
    state = safetensors_torch.load_file(os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json")) as f:
      config = json.load(f)
    write = lambda name, tensors, **changes: _write(  # noqa: E731
        tmp_path, f"{layout}_{name}", tensors, config, **changes)
    # A missing expert tensor, named with the param it belongs to.
    gone = ("model.layers.1.mlp.experts.5.up_proj.weight" if layout == "deepseek_v3" else
            "model.layers.1.mlp.experts.gate_up_proj")
    want = (r"experts\.5\.up_proj\.weight \(expert 5 of layers_1/mlp/experts/up_proj\)"
            if layout == "deepseek_v3" else
            r"experts\.gate_up_proj \(for layers_1/mlp/experts/gate_proj\)")
    bad = write("missing", {k: v for k, v in state.items() if k != gone})
    with pytest.raises(CheckpointError, match=want):
      sj.load_model(bad, dtype="float32")
    # k above the expert count.
    experts = 8 if layout == "deepseek_v3" else 4
    bad = write("topk", state, num_experts_per_tok=experts + 1)
    with pytest.raises(CheckpointError, match=rf"num_experts_per_tok must be an int between 1 "
                       rf"and num_experts \({experts}\), got {experts + 1}"):
      sj.load_model(bad, dtype="float32")
    # Unsupported rope types, in either spelling.
    for kind in ("dynamic", "longrope"):
      rope = dict(rope_type=kind, factor=2.0, rope_theta=10000.0)
      bad = write(f"rope_{kind}", state, rope_parameters=rope, rope_scaling=rope)
      with pytest.raises(CheckpointError, match=rf"rope scaling '{kind}' is not supported "
                         r"\(supported: default, linear, llama3, yarn\)"):
        sj.load_model(bad, dtype="float32")
    # A quantized checkpoint (the hub's MXFP4 gpt-oss / FP8 DeepSeek-V3).
    method = "mxfp4" if layout == "gpt_oss" else "fp8"
    bad = write("quantized", state, quantization_config=dict(quant_method=method))
    with pytest.raises(CheckpointError, match=rf"quantized checkpoint .*'{method}'.* dequantized"):
      sj.load_model(bad, dtype="float32")

  # DeepSeek's MTP layer (stored as layer N) is skipped as transformers skips it.
  directory = pairs("deepseek_v3")["directory"]
  state = safetensors_torch.load_file(os.path.join(directory, "model.safetensors"))
  with open(os.path.join(directory, "config.json")) as f:
    config = json.load(f)
  state["model.layers.2.eh_proj.weight"] = torch.zeros(48, 96)
  loaded = sj.load_model(_write(tmp_path, "mtp", state, config, num_nextn_predict_layers=1),
                         dtype="float32")
  assert loaded.config.num_layers == 2
  with pytest.raises(CheckpointError, match=r"unexpected \(1\)"):
    sj.load_model(_write(tmp_path, "no_mtp", state, config, num_nextn_predict_layers=0),
                  dtype="float32")

  # Configs.
  with pytest.raises(ValueError, match=r"num_experts_per_tok must be an int between 1 and "
                     r"num_experts \(8\), got 9"):
    get_decoder_config("deepseek_v3_tiny", num_experts_per_tok=9)
  with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) exceeds the 4 experts of the "
                     r"topk_group \(2\) groups"):
    get_decoder_config("deepseek_v3_tiny", num_experts_per_tok=5)
  with pytest.raises(ValueError, match=r"n_group \(3\) must divide num_experts"):
    get_decoder_config("deepseek_v3_tiny", n_group=3)
  with pytest.raises(ValueError, match=r"head_dim \(32\) must be qk_nope_head_dim \+ "
                     r"qk_rope_head_dim"):
    get_decoder_config("deepseek_v3_tiny", head_dim=32)
  with pytest.raises(ValueError, match="multi-head latent attention is DeepSeek-V3's"):
    get_decoder_config("llama_tiny", kv_lora_rank=8)
  with pytest.raises(ValueError, match="swiglu_limit must be > 0"):
    get_decoder_config("gpt_oss_tiny", swiglu_limit=None)
  with pytest.raises(ValueError, match="rope_scaling must be one of"):
    get_decoder_config("gpt_oss_tiny", rope_scaling="longrope")


# ---------------------------------------------------------------------------
# Named shapes and hub config.json files.

# deepseek-ai/DeepSeek-V3 and openai/gpt-oss-20b config.json, abridged (the quantization
# configs kept: they parse; loading such weights is refused).
_HUB_CONFIGS = {
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
        "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
        "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
        "max_position_embeddings": 163840, "model_type": "deepseek_v3",
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
        "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
        "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                "quant_method": "fp8", "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
        "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
        "v_head_dim": 128, "vocab_size": 129280},
    "gpt_oss_20b": {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002,
        "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
        "initial_context_length": 4096, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
        "num_local_experts": 32, "pad_token_id": 199999,
        "quantization_config": {"quant_method": "mxfp4"}, "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                         "original_max_position_embeddings": 4096, "rope_type": "yarn",
                         "truncate": False},
        "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "vocab_size": 201088},
}


def test_named_shapes_hub_configs_and_memory_plan():
  # Totals: DeepSeek-V3 671.0B without its MTP layer (the hub's 685B counts the 14B MTP
  # module), gpt-oss-20b 20.9B.
  assert DECODER_CONFIGS["deepseek_v3"].num_params == 671_026_419_200
  assert DECODER_CONFIGS["gpt_oss_20b"].num_params == 20_914_757_184
  assert get_decoder_config("gpt-oss-20b") is DECODER_CONFIGS["gpt_oss_20b"]
  for name, hub in _HUB_CONFIGS.items():
    parsed = cdo.hf_config_to_decoder_config(hub)
    named = get_decoder_config(name, dtype="float32")
    for field in dataclasses.fields(named):
      if field.name not in ("pad_id", "bos_id"):  # gpt-oss's hub file names neither's BOS.
        assert getattr(parsed, field.name) == getattr(named, field.name), (name, field.name)
  # Values cached per token and layer: DeepSeek-V3's latent (512) and rotary key (64);
  # gpt-oss's 8 kv heads' keys and values (64 + 64 each).
  for name, layers, per_token in (("deepseek_v3", 61, 512 + 64), ("gpt_oss_20b", 24, 8 * 128)):
    config = DECODER_CONFIGS[name]
    assert family_of(config).name == "decoder_only"
    # Planned from shapes alone (nothing allocated), with a 4-way model axis (the experts'
    # units and the heads split).
    plan = sj.plan_memory(config, batch=2, context_len=512, max_decode_len=128,
                          mesh_shape="1,4", dtype="bfloat16")
    assert plan.params_bytes == 2 * config.num_params
    assert plan.params_bytes_per_device < 0.27 * plan.params_bytes, name
    # DeepSeek: the latent cache (mla_cache 'latent'), replicated over `model`.
    assert plan.cache_bytes == 2 * layers * (512 + 127) * per_token * 2
  # The tiny named shapes: parameter counts from the abstract tree (both are built and
  # decoded by the per-config tests of test_decoder_only_sharding / load_model).
  for name in ("deepseek_v3_tiny", "gpt_oss_tiny"):
    config = DECODER_CONFIGS[name]
    params = family_of(config).abstract_params(config)
    assert config.num_params == sum(x.size for x in jax.tree_util.tree_leaves(params))
