"""Gemma 1 / 2 / 3 (text) and Mistral: layout variants of the decoder-only family.

Tiny random transformers models (hidden 64, head_dim 16, vocab 256) whose
sliding windows (4-5) are shorter than prompt + output, saved with
save_pretrained and loaded through `specdec_jax.load_model`:

* teacher-forced logits within 1e-4 of transformers (float32), past the window,
  and far from it when the window (or Gemma 3's second rotary base) is dropped;
* greedy generation token for token vs transformers' `generate`, prompts of
  different lengths in one batch; speculative decoding (draft: the target's
  first layers, a smaller model of the same family and vocabulary) equal to
  target-only decoding in float32 and bfloat16;
* cached blocks at ragged per-row positions == the uncached forward;
* speculative sampling follows the target's enumerated distribution
  (chi-square) for a sliding-window pair;
* config.json files as the hub ships them parse to the named configs, export
  round-trips, multimodal Gemma 3 prefixes, and clear errors.
"""

import collections
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cached_blocks import score_in_ragged_blocks
from hf_reference import assert_matches_rows, hf_greedy

import specdec_jax
from specdec_jax.families.decoder_only import checkpoints as cdo
from specdec_jax.families.tensor_io import CheckpointError
from specdec_jax.families.decoder_only.model import DecoderOnlyModel
from specdec_jax.families.decoder_only.config import (DECODER_CONFIGS, DecoderOnlyConfig,
                                                get_decoder_config, sliding_pattern)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 256
EOS = 2
LAYOUTS = ["gemma", "gemma2", "gemma3", "mistral"]
# Mixed lengths; with 10 new tokens every row runs past windows of 4-5.
LENGTHS = [3, 9, 6, 12]
STEPS = 10


def _hf_model(layout: str):
  """A random tiny transformers model of `layout`, every parameter randomised.

  HF's init (normal(0.02), Gemma norms at 0) gives near-uniform logits; wider
  weights make outputs depend on the input, so a wrong mask or norm shows.
  The embedding stays narrow: tied and scaled by sqrt(hidden), a wide one
  makes greedy decoding repeat one token; the final norm's larger scale
  restores logits of a few units. Soft-caps are small (3 and 10) so that they
  actually bend scores and logits.
  """
  common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=128, bos_token_id=1,
                eos_token_id=EOS, pad_token_id=0)
  if layout == "gemma":
    config = transformers.GemmaConfig(num_hidden_layers=2, **common)
    cls = transformers.GemmaForCausalLM
  elif layout == "gemma2":
    # Default layer_types: sliding, full, sliding. query_pre_attn_scalar != head_dim.
    config = transformers.Gemma2Config(num_hidden_layers=3, sliding_window=5,
                                       query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                                       final_logit_softcapping=10.0, **common)
    cls = transformers.Gemma2ForCausalLM
  elif layout == "gemma3":
    # Two rotary bases, both small so rotations differ within 20 positions;
    # linear scaling on the full layer only.
    config = transformers.Gemma3TextConfig(
        num_hidden_layers=3, sliding_window=4, query_pre_attn_scalar=20,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000.0}}, **common)
    cls = transformers.Gemma3ForCausalLM
  elif layout == "mistral":
    config = transformers.MistralConfig(num_hidden_layers=2, sliding_window=4, rms_norm_eps=1e-5,
                                        **common)
    cls = transformers.MistralForCausalLM
  else:
    raise ValueError(layout)
  torch.manual_seed(0)
  model = cls(config).eval()
  centre = 0.0 if layout.startswith("gemma") else 1.0  # Gemma norms compute 1 + w.
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = torch.randn_like(param)
      if name == "model.norm.weight":
        param.copy_(centre + 3.0 + 0.2 * noise)
      elif "norm" in name:
        param.copy_(centre + 0.2 * noise)
      else:
        param.copy_((0.05 if "embed_tokens" in name else 0.25) * noise)
  return model


@pytest.fixture(scope="module")
def hf_pairs(tmp_path_factory):
  """layout -> (HF torch model, our float32 model loaded from its directory, directory)."""
  pairs = {}

  def get(layout):
    if layout not in pairs:
      hf = _hf_model(layout)
      directory = str(tmp_path_factory.mktemp(layout))
      hf.save_pretrained(directory)
      pairs[layout] = (hf, specdec_jax.load_model(directory, dtype="float32"), directory)
    return pairs[layout]

  return get


def _random_prompts(lengths, seed, vocab=VOCAB):
  rng = np.random.RandomState(seed)
  prompts = np.zeros((len(lengths), max(lengths)), np.int32)
  for b, n in enumerate(lengths):
    prompts[b, :n] = rng.randint(3, vocab, n)
  return prompts


def _hf_logits(hf, tokens):
  with torch.no_grad():
    return hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def _first_layers(model: DecoderOnlyModel, k: int) -> DecoderOnlyModel:
  """The target cut to its first k layers (same embedding, final norm, head):
  a smaller model of the same family and vocabulary whose guesses are
  correlated with the target's, so some drafts are accepted and some not."""
  cfg = model.config
  types = None if cfg.layer_types is None else cfg.layer_types[:k]
  keep = {f"layers_{i}" for i in range(k)}
  params = {name: value for name, value in model.params.items()
            if not name.startswith("layers_") or name in keep}
  return DecoderOnlyModel(cfg.replace(num_layers=k, layer_types=types), params)


# ---------------------------------------------------------------------------
# Parity with transformers.

@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_transformers_past_the_window(layout, hf_pairs):
  hf, model, _ = hf_pairs(layout)
  cfg = model.config
  assert cfg.family == layout
  assert sum(x.size for x in jax.tree_util.tree_leaves(model.params)) == cfg.num_params
  tokens = _random_prompts([20, 20, 20], seed=1)  # 20 positions, windows of 4-5.
  want = _hf_logits(hf, tokens)
  got = np.asarray(model.logits(tokens))
  assert np.abs(want).max() > 1.0, "near-zero logits would prove nothing"
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  if layout == "gemma2":
    assert cfg.attn_logit_softcap == 3.0 and cfg.final_logit_softcap == 10.0
    assert np.abs(want).max() < 10.0  # Capped.
  # The window shapes these logits: without it the same weights agree inside
  # the first window and are far off after it.
  if cfg.sliding_window is not None:
    windowless = cfg.replace(sliding_window=1000)  # Same layers and rotary, no effective window.
    other = np.asarray(DecoderOnlyModel(windowless, model.params).logits(tokens))
    np.testing.assert_allclose(other[:, :4], want[:, :4], atol=1e-4, rtol=0)
    assert np.abs(other[:, 6:] - want[:, 6:]).max() > 0.1
  if cfg.sliding_rope_theta is not None:  # And so do Gemma 3's two rotary tables.
    one_table = cfg.replace(sliding_rope_theta=None, rope_scaling=None)
    other = np.asarray(DecoderOnlyModel(one_table, model.params).logits(tokens))
    assert np.abs(other - want).max() > 0.1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_and_speculative_match_transformers_ragged_prompts(layout, hf_pairs):
  """Target-only and speculative greedy (draft: the first layer(s)) == HF, per row."""
  hf, model, _ = hf_pairs(layout)
  prompts = _random_prompts(LENGTHS, seed=2)
  want = hf_greedy(hf, prompts, LENGTHS, STEPS, EOS)
  assert any(len(set(w)) >= 5 for w in want), f"degenerate outputs prove nothing: {want}"
  target = specdec_jax.generate(model, prompts, LENGTHS, max_decode_steps=STEPS)
  assert_matches_rows(target.sequences, want)
  assert np.asarray(target.lengths).tolist() == [len(w) for w in want]
  draft = _first_layers(model, 1)
  spec = specdec_jax.generate(model, prompts, LENGTHS, max_decode_steps=STEPS, draft=draft,
                              gamma=3)
  np.testing.assert_array_equal(np.asarray(spec.sequences), np.asarray(target.sequences))
  stats = spec.stats
  assert 0 < stats.acceptance_rate < 1, "the cut-down draft should be partly right"
  assert (stats.accepted + stats.iterations == stats.emitted).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bfloat16_speculative_equals_target_only(layout, hf_pairs):
  """bf16 weights and compute: one target block width in both loops, so
  rounding cannot split speculative from target-only greedy outputs."""
  _, _, directory = hf_pairs(layout)
  model = specdec_jax.load_model(directory, dtype="bfloat16")
  assert {x.dtype for x in jax.tree_util.tree_leaves(model.params)} == {jnp.dtype("bfloat16")}
  prompts = _random_prompts(LENGTHS, seed=3)
  want = specdec_jax.generate(model, prompts, LENGTHS, max_decode_steps=STEPS, eos_id=-1)
  got = specdec_jax.generate(model, prompts, LENGTHS, max_decode_steps=STEPS, eos_id=-1,
                             draft=_first_layers(model, 1), gamma=3)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  assert 0 < got.stats.acceptance_rate < 1
  assert len(set(np.asarray(want.sequences).ravel().tolist())) >= 8


@pytest.mark.parametrize("layout", ["gemma3", "mistral"])
def test_cached_blocks_at_ragged_positions_equal_uncached_forward(layout, hf_pairs):
  """Ragged prefill, then blocks of 3 at per-row positions whose tail is a
  rejected draft (junk written into the cache, then overwritten): every logit
  equals the uncached forward's, also where the cache holds keys outside the
  window."""
  _, model, _ = hf_pairs(layout)
  batch, length, k = 3, 18, 3
  rng = np.random.RandomState(0)
  tokens = rng.randint(3, VOCAB, (batch, length)).astype(np.int32)
  full = np.asarray(model.logits(tokens))
  prompt_lengths = np.array([5, 1, 8], np.int32)
  last, got = score_in_ragged_blocks(model, tokens, prompt_lengths, (k,), rng, VOCAB)
  np.testing.assert_allclose(last, full[np.arange(batch), prompt_lengths - 1], atol=1e-4, rtol=0)
  for b in range(batch):
    real = slice(prompt_lengths[b], length)
    np.testing.assert_allclose(got[b, real], full[b, real], atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------
# Sampling is exact for a sliding-window pair.

P_VALUE = 1e-4  # Per-test false-alarm rate (as tests/test_speculative.py).


def _chi_square(observed, expected, n):
  """(p-value, degrees of freedom): cells with expected count >= 5, the rest lumped."""
  from scipy import stats as scipy_stats
  big = [key for key, p in expected.items() if p * n >= 5]
  obs = [observed.get(key, 0) for key in big]
  exp = [expected[key] * n for key in big]
  if n - sum(exp) >= 5:
    obs.append(n - sum(obs))
    exp.append(n - sum(exp))
  obs, exp = np.array(obs, np.float64), np.array(exp, np.float64)
  result = scipy_stats.chisquare(obs, exp / exp.sum() * obs.sum(), sum_check=False)
  return result.pvalue, len(obs) - 1


def _continuations(model, prompt, steps, temperature):
  """P(new tokens) over every continuation of `prompt` (no EOS in this vocabulary's use)."""
  from specdec_jax.core import sampling
  vocab = model.config.vocab_size
  seqs = np.array(list(itertools.product(range(vocab), repeat=steps)), np.int32)
  full = np.concatenate([np.repeat(prompt[None], len(seqs), axis=0), seqs], axis=1)
  logits = model.logits(full)[:, len(prompt) - 1:-1]
  probs = np.asarray(sampling.adjust_probs(logits, temperature=temperature))
  chain = np.prod(np.take_along_axis(probs, seqs[..., None], axis=-1)[..., 0], axis=1)
  return {tuple(seq): p for seq, p in zip(seqs.tolist(), chain)}


def test_speculative_samples_follow_target_distribution_sliding_window():
  """Gemma 2 layout (window 3 on both layers, soft-caps on), vocab 8, 3 new
  tokens after ragged prompts of 6 and 2: each row's 512 continuations are
  enumerated from the uncached forward and 8,000 speculative samples per row
  compared by chi-square at p 1e-4.

  Power: after lumping cells of expected count < 5 the rows keep 189 and 167
  degrees of freedom, so any wrong rule with chi-square effect
  sum((p_wrong - p)^2 / p) >= 0.019 is caught with power >= 0.99 (noncentral
  chi-square, lambda = 8,000 x effect, at p 1e-4). Ignoring the window has
  effect 0.37 on the prompt of 6 (power 1.0); the test recomputes that effect
  and asserts power >= 0.99, so it is known to see the window.
  """
  from scipy import stats as scipy_stats
  vocab, steps, n = 8, 3, 8_000
  config = DecoderOnlyConfig(
      family="gemma2", vocab_size=vocab, emb_dim=32, num_layers=2, num_heads=2,
      num_kv_heads=1, head_dim=16, mlp_dim=64, max_positions=64, norm_epsilon=1e-6,
      activation="gelu_new", tie_word_embeddings=True, norm_offset=1.0, scale_embeddings=True,
      sandwich_norms=True, query_pre_attn_scalar=16.0, attn_logit_softcap=5.0,
      final_logit_softcap=6.0, sliding_window=3,
      layer_types=("sliding_attention", "sliding_attention"), bos_id=1, eos_id=None, pad_id=0)
  base = specdec_jax.load_model(config, seed=11, dtype="float32")
  # Sharpen the normal(0.02) init so the distribution is far from uniform.
  target = DecoderOnlyModel(config, jax.tree_util.tree_map(
      lambda x: x * 8.0 if x.ndim == 2 else x, base.params))
  leaves, treedef = jax.tree_util.tree_flatten(target.params)
  keys = jax.random.split(jax.random.PRNGKey(13), len(leaves))
  draft = DecoderOnlyModel(config, jax.tree_util.tree_unflatten(
      treedef, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]))
  prompts = [np.array([5, 3, 7, 4, 6, 3], np.int32), np.array([3, 6], np.int32)]
  batch = np.zeros((2 * n, 6), np.int32)
  batch[:n] = prompts[0]
  batch[n:, :2] = prompts[1]
  lengths = np.array([6] * n + [2] * n, np.int32)
  out = specdec_jax.generate(target, batch, lengths, max_decode_steps=steps, draft=draft,
                             gamma=2, temperature=1.0, rng=jax.random.PRNGKey(7))
  assert 0.02 < out.stats.acceptance_rate < 0.98
  sequences = np.asarray(out.sequences).tolist()
  for rows, prompt in ((sequences[:n], prompts[0]), (sequences[n:], prompts[1])):
    expected = _continuations(target, prompt, steps, 1.0)
    observed = collections.Counter(map(tuple, rows))
    assert len(observed) > 50, "too few distinct outputs to test a distribution"
    pvalue, dof = _chi_square(observed, expected, n)
    assert pvalue > P_VALUE, (pvalue, dof)
    if len(prompt) == 6:
      windowless = DecoderOnlyModel(config.replace(sliding_window=1000), target.params)
      wrong = _continuations(windowless, prompt, steps, 1.0)
      effect = sum((wrong[key] - p) ** 2 / p for key, p in expected.items() if p > 0)
      critical = scipy_stats.chi2.isf(P_VALUE, dof)
      assert scipy_stats.ncx2.sf(critical, dof, n * effect) >= 0.99, (effect, dof)


# ---------------------------------------------------------------------------
# Named configs, hub config.json files, export, multimodal prefixes, errors.

# Published parameter counts (HF model cards / safetensors totals; Gemma 3
# 4B+ are the multimodal releases, whose text models are checked by shape).
_PUBLISHED = {"gemma_2b": 2_506_172_416, "gemma_7b": 8_537_680_896,
              "gemma2_2b": 2_614_341_888, "gemma2_9b": 9_241_705_984,
              "gemma2_27b": 27_227_128_320, "gemma3_1b": 999_885_952,
              "mistral_7b": 7_241_732_096}


def test_named_configs_have_the_released_sizes():
  for name, count in _PUBLISHED.items():
    assert DECODER_CONFIGS[name].num_params == count, name
  g3 = DECODER_CONFIGS["gemma3_27b"]
  assert g3.attention_types.count("full_attention") == 10 and g3.attention_types[5] == (
      "full_attention")
  assert (g3.query_pre_attn_scalar, g3.sliding_window, g3.rope_factor) == (168.0, 1024, 8.0)
  assert get_decoder_config("gemma-2-9b") is DECODER_CONFIGS["gemma2_9b"]
  assert DECODER_CONFIGS["mistral_7b"].attention_types == ("sliding_attention",) * 32


# config.json as the hub ships them, abridged to the fields that matter.
_HUB_CONFIGS = {
    "gemma_2b": {  # google/gemma-2b
        "architectures": ["GemmaForCausalLM"], "attention_bias": False, "bos_token_id": 2,
        "eos_token_id": 1, "head_dim": 256, "hidden_act": "gelu", "hidden_size": 2048,
        "intermediate_size": 16384, "max_position_embeddings": 8192, "model_type": "gemma",
        "num_attention_heads": 8, "num_hidden_layers": 18, "num_key_value_heads": 1,
        "pad_token_id": 0, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
        "vocab_size": 256000},
    "gemma2_9b": {  # google/gemma-2-9b
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": False,
        "attn_logit_softcapping": 50.0, "bos_token_id": 2, "eos_token_id": 1,
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584,
        "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "gemma2",
        "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 256000},
    "gemma3_1b": {  # google/gemma-3-1b-pt
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
        "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1,
        "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
        "intermediate_size": 6912, "max_position_embeddings": 32768,
        "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26,
        "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "vocab_size": 262144},
    "gemma3_4b": {  # google/gemma-3-4b-pt: multimodal, the text_config relies on defaults.
        "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
        "model_type": "gemma3", "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}},
    "mistral_7b": {  # mistralai/Mistral-7B-v0.1
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
        "vocab_size": 32000},
}


@pytest.mark.parametrize("name", sorted(_HUB_CONFIGS))
def test_hub_config_json_parses_to_the_named_config(name):
  parsed = cdo.hf_config_to_decoder_config(_HUB_CONFIGS[name])
  assert parsed == get_decoder_config(name, dtype="float32")


def test_null_sliding_window_and_old_gemma3_rope_fields():
  # Mistral v0.2+: "sliding_window": null, every layer full.
  hub = dict(_HUB_CONFIGS["mistral_7b"], sliding_window=None, rope_theta=1000000.0)
  parsed = cdo.hf_config_to_decoder_config(hub)
  assert parsed.sliding_window is None and set(parsed.attention_types) == {"full_attention"}
  # transformers 5 keys Gemma 3's rotary by layer type.
  hub = dict(_HUB_CONFIGS["gemma3_1b"], rope_parameters={
      "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
  parsed = cdo.hf_config_to_decoder_config(hub)
  assert (parsed.rope_scaling, parsed.rope_factor, parsed.rope_theta,
          parsed.sliding_rope_theta) == ("linear", 8.0, 1e6, 1e4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_hf_round_trip(layout, hf_pairs, tmp_path):
  """Our model -> HF directory: transformers reproduces our logits; we reload it exactly."""
  _, model, _ = hf_pairs(layout)
  cdo.export_hf_decoder_only(model, tmp_path)
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  tokens = _random_prompts([16, 16], seed=4)
  np.testing.assert_allclose(np.asarray(model.logits(tokens)), _hf_logits(hf, tokens),
                             atol=1e-4, rtol=0)
  again = specdec_jax.load_model(str(tmp_path), dtype="float32")
  assert again.config == model.config
  for a, b in zip(jax.tree_util.tree_leaves(again.params),
                  jax.tree_util.tree_leaves(model.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_multimodal_gemma3_directory_loads_its_text_model(hf_pairs, tmp_path):
  """Gemma3ForConditionalGeneration files: text_config, `language_model.model.`
  (transformers 4 hub) or `model.language_model.` (5) prefixes, vision tensors."""
  from safetensors.numpy import load_file, save_file
  _, model, directory = hf_pairs("gemma3")
  with open(os.path.join(directory, "config.json")) as f:
    text_config = json.load(f)
  state = load_file(os.path.join(directory, "model.safetensors"))
  tokens = _random_prompts([9, 9], seed=5)
  want = np.asarray(model.logits(tokens))
  for prefix in ("language_model.", "model.language_model."):
    out = tmp_path / prefix.rstrip(".")
    out.mkdir()
    renamed = {(prefix + k if prefix == "language_model." else
                k.replace("model.", prefix, 1)): v for k, v in state.items()}
    renamed["vision_tower.vision_model.post_layernorm.weight"] = np.ones(4, np.float32)
    renamed["multi_modal_projector.mm_input_projection_weight"] = np.ones((4, 64), np.float32)
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    with open(out / "config.json", "w") as f:
      json.dump({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                 "text_config": text_config, "vision_config": {}}, f)
    loaded = specdec_jax.load_model(str(out), dtype="float32")
    assert loaded.config == model.config
    np.testing.assert_array_equal(np.asarray(loaded.logits(tokens)), want)


def test_unsupported_architecture_error_names_every_supported_one(tmp_path):
  supported = sorted(cdo.ARCHITECTURES) + ["T5ForConditionalGeneration",
                                           "MT5ForConditionalGeneration"]
  assert {"Gemma3ForCausalLM", "MistralForCausalLM", "LlamaForCausalLM",
          "T5ForConditionalGeneration", "MT5ForConditionalGeneration"} <= set(supported)
  directory = tmp_path / "phi"
  directory.mkdir()
  with open(directory / "config.json", "w") as f:
    json.dump({"architectures": ["PhiForCausalLM"], "model_type": "phi"}, f)
  # The public entry names every family's architectures; the decoder-only
  # loader its own.
  for load, names in ((specdec_jax.load_model, supported),
                      (cdo.load_hf_decoder_only, sorted(cdo.ARCHITECTURES))):
    with pytest.raises(CheckpointError) as err:
      load(str(directory))
    message = str(err.value)
    assert "phi" in message
    for name in names:
      assert name in message, (load, name, message)


def test_bad_configs_are_clear_errors():
  gemma3 = DECODER_CONFIGS["gemma3_1b"]
  with pytest.raises(ValueError, match="layer_types has 26 entries but num_layers is 2"):
    gemma3.replace(num_layers=2)
  assert gemma3.replace(num_layers=2, layer_types=sliding_pattern(2, 6)).num_layers == 2
  with pytest.raises(ValueError, match="entries must be in"):
    gemma3.replace(layer_types=("local",) * 26)
  with pytest.raises(ValueError, match="must be a tuple"):
    gemma3.replace(layer_types=list(gemma3.layer_types))
  with pytest.raises(ValueError, match="sliding_window is None"):
    gemma3.replace(sliding_window=None)
  with pytest.raises(ValueError, match="sliding_window must be None or a positive int"):
    gemma3.replace(sliding_window=0)
  with pytest.raises(ValueError, match="attn_logit_softcap must be None or > 0"):
    gemma3.replace(attn_logit_softcap=0.0)
  with pytest.raises(ValueError, match="qk_norm and sliding_rope_theta need a rotary family"):
    DECODER_CONFIGS["gpt2_tiny"].replace(qk_norm=True)
  # The exporter refuses what the family's HF class cannot compute.
  params = None
  for config, match in (
      (DECODER_CONFIGS["gemma2_2b"].replace(sandwich_norms=False), "gemma2 fixes"),
      (DECODER_CONFIGS["llama_tiny"].replace(sliding_window=8), "no counterpart of sliding"),
      (DECODER_CONFIGS["gemma3_1b"].replace(attn_logit_softcap=50.0),
       "no counterpart of attn_logit_softcap"),
      (DECODER_CONFIGS["mistral_7b"].replace(layer_types=sliding_pattern(32, 2)),
       "one window on every layer")):
    with pytest.raises(ValueError, match=match):
      cdo.export_hf_decoder_only(DecoderOnlyModel(config, params), "/nonexistent")
