"""Qwen3 (`Qwen3ForCausalLM`): the Llama layout plus per-head q/k RMSNorms (x * w).

Tiny random transformers models (vocab 101, 2 layers, head_dim != hidden / heads),
one tied and one untied with attention biases, saved with save_pretrained and
loaded through `specdec_jax.load_model`:

* logits within 1e-5 of transformers in float32, teacher-forced and from the
  prefill of right-padded prompts of mixed lengths (prompt_lengths); the q/k
  norm scales shape them;
* greedy generation token for token vs transformers' `generate`, and
  speculative greedy with a smaller Qwen3 draft (the target's first layer,
  written as its own Qwen3 directory, as `sj.ModelDraft`) equal to
  target-only, in float32 and (bit for bit) bfloat16;
* the named shapes (Qwen3 0.6B..8B) as the hub's config.json files say, planned
  without allocation; export round trip; function-preserving widening; errors.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import assert_matches_rows, hf_greedy, hf_logits, ragged_prompts

import specdec_jax as sj
from specdec_jax.families.decoder_only import checkpoints as cdo
from specdec_jax.families.decoder_only.config import DECODER_CONFIGS, get_decoder_config
from specdec_jax.families.decoder_only.model import DecoderOnlyModel, decode_cache_length
from specdec_jax.families.tensor_io import CheckpointError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 101
EOS = 2
LENGTHS = [3, 9, 6, 12]  # Mixed prompt lengths, right-padded to 12.
STEPS = 10
TOL = 1e-5  # Float32: transformers and we each lie ~5e-6 from a float64 forward here
            # (|logits| < 8); larger logits scale that rounding up.

# Both have head_dim != hidden / heads (16 vs 12, 24 vs 16) and grouped-query attention.
LAYOUTS = {
    "tied": dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, tie_word_embeddings=True),
    "untied_biases": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                          head_dim=24, intermediate_size=80, tie_word_embeddings=False,
                          attention_bias=True, rms_norm_eps=1e-5,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
}


def _hf_model(layout: str):
  """A random tiny Qwen3ForCausalLM with every parameter randomised.

  HF's init (normal(0.02), unit norms, zero biases) gives near-uniform logits
  and would hide a wrong norm or bias. The q/k norm scales are drawn around 1
  with a wide spread, so reading them as Gemma's (1 + w) or dropping them shows.
  """
  config = transformers.Qwen3Config(vocab_size=VOCAB, num_hidden_layers=2,
                                    max_position_embeddings=128, bos_token_id=1,
                                    eos_token_id=EOS, pad_token_id=0, **LAYOUTS[layout])
  torch.manual_seed(0 if layout == "tied" else 1)
  model = transformers.Qwen3ForCausalLM(config).eval()
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = torch.randn_like(param)
      if name == "model.norm.weight":
        param.copy_(2.0 + 0.2 * noise)
      elif name.endswith(("q_norm.weight", "k_norm.weight")):
        param.copy_(1.0 + 0.5 * noise)
      elif "norm" in name:
        param.copy_(1.0 + 0.2 * noise)
      else:
        param.copy_((0.1 if name.endswith(("embed_tokens.weight", "lm_head.weight")) else 0.15)
                    * noise)
  return model


def _first_layer(hf):
  """The target cut to its first layer (same embedding, final norm and head), as its own
  Qwen3ForCausalLM: a smaller Qwen3 whose guesses agree with the target's some of the time."""
  config = hf.config.to_dict()
  config.update(num_hidden_layers=1, layer_types=config["layer_types"][:1])
  small = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config)).eval()
  state = {k: v for k, v in hf.state_dict().items() if ".layers.1." not in k}
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
      draft_directory = str(tmp_path_factory.mktemp(layout + "_draft"))
      _first_layer(hf).save_pretrained(draft_directory)
      cache[layout] = dict(hf=hf, model=sj.load_model(directory, dtype="float32"),
                           directory=directory, draft_directory=draft_directory)
    return cache[layout]

  return get


def _prompts(lengths, seed):
  return ragged_prompts(lengths, seed, VOCAB)


# ---------------------------------------------------------------------------
# Parity with transformers.

@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logits_match_transformers(layout, pairs):
  pair = pairs(layout)
  hf, model = pair["hf"], pair["model"]
  cfg, spec = model.config, LAYOUTS[layout]
  assert (cfg.family, cfg.qk_norm, cfg.norm_offset, cfg.head_dim, cfg.tie_word_embeddings,
          cfg.qkv_bias, cfg.out_bias, cfg.mlp_bias) == (
              "qwen3", True, 0.0, spec["head_dim"], spec["tie_word_embeddings"],
              spec.get("attention_bias", False), spec.get("attention_bias", False), False)
  assert cfg.head_dim * cfg.num_heads != cfg.emb_dim
  assert ("lm_head" in model.params) != cfg.tie_word_embeddings
  assert model.params["layers_1"]["self_attn"]["k_norm"]["scale"].shape == (cfg.head_dim,)
  assert sum(x.size for x in jax.tree_util.tree_leaves(model.params)) == cfg.num_params

  # Teacher-forced, full rows.
  tokens = _prompts([20, 20, 20], seed=1)
  want = hf_logits(hf, tokens)
  got = np.asarray(model.logits(tokens))
  assert np.abs(want).max() > 1.0, "near-zero logits would prove nothing"
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)

  # Right-padded prompts of mixed lengths: the prefill's logits at each row's last
  # prompt token, and the teacher-forced logits of each row's real tokens, equal
  # transformers' on the unpadded row.
  prompts = _prompts(LENGTHS, seed=2)
  last, _ = model.prefill(prompts, np.array(LENGTHS, np.int32),
                          model.init_cache(len(LENGTHS), prompts.shape[1]))
  padded = np.asarray(model.logits(prompts))
  for b, n in enumerate(LENGTHS):
    row = hf_logits(hf, prompts[b:b + 1, :n])[0]
    np.testing.assert_allclose(np.asarray(last)[b], row[-1], atol=TOL, rtol=0)
    np.testing.assert_allclose(padded[b, :n], row, atol=TOL, rtol=0)

  # The q/k norm scales (read as x * w) shape these logits.
  params = jax.tree_util.tree_map(lambda x: x, model.params)
  for i in range(cfg.num_layers):
    for norm in ("q_norm", "k_norm"):
      params[f"layers_{i}"]["self_attn"][norm] = {"scale": jnp.ones((cfg.head_dim,))}
  unit = np.asarray(DecoderOnlyModel(cfg, params).logits(tokens))
  assert np.abs(unit - want).max() > 0.1


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_greedy_and_speculative_match_transformers(layout, pairs):
  """Target-only greedy == HF generate per row (ragged prompts, prompt_lengths);
  speculative greedy with a smaller Qwen3 draft == target-only."""
  pair = pairs(layout)
  hf, model = pair["hf"], pair["model"]
  prompts = _prompts(LENGTHS, seed=3)
  want = hf_greedy(hf, prompts, LENGTHS, STEPS, EOS)
  assert any(len(set(w)) >= 5 for w in want), f"degenerate outputs prove nothing: {want}"
  target = sj.generate(model, prompts, LENGTHS, max_decode_steps=STEPS)
  assert_matches_rows(target.sequences, want)
  assert np.asarray(target.lengths).tolist() == [len(w) for w in want]

  small = sj.load_model(pair["draft_directory"], dtype="float32")
  assert (small.config.family, small.config.num_layers) == ("qwen3", 1)
  spec = sj.generate(model, prompts, LENGTHS, max_decode_steps=STEPS, draft=sj.ModelDraft(small),
                     gamma=3)
  np.testing.assert_array_equal(np.asarray(spec.sequences), np.asarray(target.sequences))
  stats = spec.stats
  assert 0 < stats.acceptance_rate < 1, "the one-layer draft should be partly right"
  assert (stats.accepted + stats.iterations == stats.emitted).all()


def test_bfloat16_speculative_is_bit_identical_to_target_only(pairs):
  """bf16 weights and compute (the untied layout with biases; the tied one runs the same
  code in float32 above): one target block width in both loops, so rounding cannot split
  speculative from target-only greedy outputs."""
  pair = pairs("untied_biases")
  model = sj.load_model(pair["directory"], dtype="bfloat16")
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
# Named shapes, hub config.json files, export, widening, errors.

# Qwen/Qwen3-0.6B and Qwen/Qwen3-8B config.json (transformers 4.51 format), abridged.
_HUB_CONFIGS = {
    "qwen3_0_6b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
        "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
        "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
        "use_sliding_window": False, "vocab_size": 151936},
    "qwen3_8b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
        "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
        "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
        "use_sliding_window": False, "vocab_size": 151936},
}

# Model cards: non-embedding parameters (0.44B, 1.4B, 3.6B, 6.95B).
_NON_EMBEDDING = {"qwen3_0_6b": 0.44e9, "qwen3_1_7b": 1.4e9, "qwen3_4b": 3.6e9,
                  "qwen3_8b": 6.95e9}


def test_named_shapes_hub_configs_and_memory_plan():
  for name, count in _NON_EMBEDDING.items():
    cfg = DECODER_CONFIGS[name]
    embedding = cfg.vocab_size * cfg.emb_dim * (1 if cfg.tie_word_embeddings else 2)
    assert abs((cfg.num_params - embedding) / count - 1) < 0.01, name
    assert (cfg.family, cfg.head_dim, cfg.qk_norm, cfg.qkv_bias) == ("qwen3", 128, True, False)
  assert DECODER_CONFIGS["qwen3_8b"].num_params == 8_190_735_360
  assert get_decoder_config("qwen3-0.6b") is DECODER_CONFIGS["qwen3_0_6b"]
  for name, hub in _HUB_CONFIGS.items():
    parsed = cdo.hf_config_to_decoder_config(hub)
    named = get_decoder_config(name, dtype="float32")
    for field in dataclasses.fields(named):
      if field.name != "pad_id":  # Not in the hub file; it only fills prompt padding.
        assert getattr(parsed, field.name) == getattr(named, field.name), (name, field.name)
  # Planned from shapes alone: 8.2B bf16 params are not allocated.
  plan = sj.plan_memory(DECODER_CONFIGS["qwen3_8b"], batch=2, context_len=512,
                        max_decode_len=128, mesh_shape="1,1", dtype="bfloat16")
  assert plan.params_bytes == 2 * DECODER_CONFIGS["qwen3_8b"].num_params
  positions = decode_cache_length(512, 128)  # Prompt + new tokens (the last is never written).
  assert plan.cache_bytes == 2 * 36 * 2 * positions * 8 * 128 * 2  # Rows, layers, K and V, bf16.
  # The tiny named config builds random weights through the public entry.
  tiny = sj.load_model("qwen3_tiny", seed=0, dtype="float32")
  assert tiny.config.head_dim * tiny.config.num_heads != tiny.config.emb_dim
  assert np.isfinite(np.asarray(tiny.logits(_prompts([5], seed=5)))).all()


def test_export_round_trip_widening_and_errors(pairs, tmp_path):
  pair = pairs("untied_biases")
  model = pair["model"]
  tokens = _prompts([16, 16], seed=6)
  want = np.asarray(model.logits(tokens))
  # Our model -> a Qwen3ForCausalLM directory transformers reproduces; we reload it exactly.
  cdo.export_hf_decoder_only(model, tmp_path / "export")
  with open(tmp_path / "export" / "config.json") as f:
    assert json.load(f)["architectures"] == ["Qwen3ForCausalLM"]
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
  assert type(hf).__name__ == "Qwen3ForCausalLM"
  np.testing.assert_allclose(want, hf_logits(hf, tokens), atol=TOL, rtol=0)
  again = sj.load_model(str(tmp_path / "export"), dtype="float32")
  assert again.config == model.config
  for a, b in zip(jax.tree_util.tree_leaves(again.params), jax.tree_util.tree_leaves(model.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # Widening keeps the function: q/k norms (per head_dim, which is kept) are copied.
  cfg = model.config
  large = sj.embed_model(model, cfg.replace(emb_dim=2 * cfg.emb_dim, num_heads=8, num_kv_heads=2,
                                            mlp_dim=2 * cfg.mlp_dim, num_layers=3))
  np.testing.assert_allclose(np.asarray(large.logits(tokens)), want, atol=TOL, rtol=0)
  with pytest.raises(sj.EmbeddingError, match="head_dim differs"):
    sj.embed_model(model, cfg.replace(head_dim=32))

  # Sliding windows are refused, as for Qwen2; the exporter refuses what Qwen3 cannot say.
  hub = dict(_HUB_CONFIGS["qwen3_0_6b"], use_sliding_window=True, sliding_window=4096)
  with pytest.raises(CheckpointError, match="use_sliding_window"):
    cdo.hf_config_to_decoder_config(hub)
  for bad, match in ((cfg.replace(mlp_bias=True), "Qwen3's attention_bias"),
                     (cfg.replace(out_bias=False), "Qwen3's attention_bias"),
                     (cfg.replace(qk_norm=False), "qwen3 fixes")):
    with pytest.raises(ValueError, match=match):
      cdo.decoder_config_to_hf_config(bad)
