"""Decoder-only models (Llama / Qwen2 / GPT-2 layouts): parity with transformers,
cached blocks == uncached forward, prompts of different lengths, speculative == target."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cached_blocks import score_in_ragged_blocks
from hf_reference import assert_matches_rows, hf_greedy
from flax.traverse_util import flatten_dict

import specdec_jax as sj
from specdec_jax.families.t5.checkpoints import CheckpointError
from specdec_jax.families.decoder_only.checkpoints import load_hf_decoder_only
from specdec_jax.generation import generate
from specdec_jax.families.decoder_only.model import DecoderOnlyModel
from specdec_jax.loading import load_model
from specdec_jax.families.decoder_only.config import DECODER_CONFIGS, get_decoder_config

VOCAB = 97
EOS = 2


# ---------------------------------------------------------------------------
# Hugging Face reference models (random weights, saved to tmp dirs).

def _hf_model(layout: str):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
  if layout == "llama_gqa_untied":
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96,
                                      max_position_embeddings=128, tie_word_embeddings=False,
                                      rms_norm_eps=1e-5, **common)
    cls = transformers.LlamaForCausalLM
  elif layout == "llama_biases_llama3_rope":
    # attention_bias (q/k/v/o), mlp_bias, head_dim != hidden/heads and Llama 3.1
    # rotary scaling whose bands all fall inside short test positions.
    config = transformers.LlamaConfig(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, intermediate_size=80, max_position_embeddings=128, attention_bias=True,
        mlp_bias=True, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500.0, factor=4.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64), **common)
    cls = transformers.LlamaForCausalLM
  elif layout == "qwen2_biases_tied":
    config = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96,
                                      max_position_embeddings=128, tie_word_embeddings=True,
                                      **common)
    cls = transformers.Qwen2ForCausalLM
  elif layout == "gpt2":
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, **common)
    cls = transformers.GPT2LMHeadModel
  else:
    raise ValueError(layout)
  torch.manual_seed(0)
  model = cls(config).eval()
  # HF's init (normal(0.02), unit norms, zero biases) gives near-uniform logits
  # and would hide a missing bias or norm scale: randomise every parameter.
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = torch.randn_like(param)
      is_norm = "norm" in name or ".ln_" in name
      param.copy_(1.0 + 0.2 * noise if is_norm and name.endswith("weight") else 0.15 * noise)
  return model


def _save(model, directory, **kwargs):
  model.save_pretrained(directory, **kwargs)
  return directory


LAYOUTS = ["llama_gqa_untied", "llama_biases_llama3_rope", "qwen2_biases_tied", "gpt2"]
# One layout saved sharded with an index, to cover that reader path.
_SAVE_KWARGS = {"qwen2_biases_tied": dict(max_shard_size="40KB")}


@pytest.fixture(scope="module")
def hf_pairs(tmp_path_factory):
  """layout -> (layout, HF torch model, our DecoderOnlyModel loaded from its saved
  directory, directory), each built once per module."""
  pairs = {}

  def get(layout):
    if layout not in pairs:
      hf = _hf_model(layout)
      directory = str(tmp_path_factory.mktemp(layout))
      _save(hf, directory, **_SAVE_KWARGS.get(layout, {}))
      pairs[layout] = (layout, hf, load_hf_decoder_only(directory, dtype="float32"), directory)
    return pairs[layout]

  return get


@pytest.fixture(params=LAYOUTS)
def hf_pair(request, hf_pairs):
  return hf_pairs(request.param)


def _random_prompts(lengths, seed):
  rng = np.random.RandomState(seed)
  prompts = np.zeros((len(lengths), max(lengths)), np.int32)
  for b, n in enumerate(lengths):
    prompts[b, :n] = rng.randint(3, VOCAB, n)
  return prompts


def test_loader_reads_layout_and_sharded_index(hf_pair):
  layout, hf, model, directory = hf_pair
  cfg = model.config
  assert cfg.family == layout.split("_")[0]
  assert cfg.vocab_size == VOCAB and cfg.eos_id == EOS
  if layout == "qwen2_biases_tied":
    assert os.path.exists(os.path.join(directory, "model.safetensors.index.json"))
    assert cfg.qkv_bias and not cfg.out_bias and cfg.tie_word_embeddings
  if layout == "llama_gqa_untied":
    assert cfg.num_kv_heads == 2 and not cfg.tie_word_embeddings
  if layout == "llama_biases_llama3_rope":
    assert cfg.rope_scaling == "llama3" and cfg.out_bias and cfg.mlp_bias
  leaves = jax.tree_util.tree_leaves(model.params)
  assert sum(x.size for x in leaves) == cfg.num_params


def test_logits_match_transformers(hf_pair):
  torch = pytest.importorskip("torch")
  _, hf, model, _ = hf_pair
  tokens = _random_prompts([17, 17, 17], seed=1)
  with torch.no_grad():
    want = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  got = np.asarray(model.logits(tokens))
  assert np.abs(want).max() > 1.0, "near-zero logits would prove nothing"
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers_with_ragged_prompts(hf_pair):
  _, hf, model, _ = hf_pair
  lengths = [5, 11, 2, 8]
  prompts = _random_prompts(lengths, seed=2)
  steps = 12
  want = hf_greedy(hf, prompts, lengths, steps, EOS)
  out = generate(model, prompts, lengths, max_decode_steps=steps)
  assert_matches_rows(out.sequences, want)
  assert np.asarray(out.lengths).tolist() == [len(w) for w in want]
  assert any(len(set(w)) >= 4 for w in want), "degenerate outputs prove nothing"


# Rotary + GQA and learned positions; Qwen2 differs from Llama only in biases,
# which the logits and target-only tests above cover.
@pytest.mark.parametrize("layout", ["llama_gqa_untied", "gpt2"])
def test_greedy_speculative_matches_target_and_transformers(layout, hf_pairs):
  """Draft = the target with noisy weights: some drafts rejected, output unchanged."""
  _, hf, model, _ = hf_pairs(layout)
  noise_keys = jax.random.split(jax.random.PRNGKey(7), len(jax.tree_util.tree_leaves(
      model.params)))
  leaves, treedef = jax.tree_util.tree_flatten(model.params)
  noisy = [x + 0.03 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, noise_keys)]
  draft = DecoderOnlyModel(model.config, jax.tree_util.tree_unflatten(treedef, noisy))
  lengths = [5, 11, 2, 8]
  prompts = _random_prompts(lengths, seed=3)
  steps = 12
  target = generate(model, prompts, lengths, max_decode_steps=steps)
  spec = generate(model, prompts, lengths, max_decode_steps=steps, draft=draft,
                               gamma=3)
  np.testing.assert_array_equal(np.asarray(spec.sequences), np.asarray(target.sequences))
  assert_matches_rows(spec.sequences, hf_greedy(hf, prompts, lengths, steps, EOS))
  stats = spec.stats
  assert 0 < stats.acceptance_rate < 1, "the noisy draft should be partly right"
  np.testing.assert_array_equal(stats.emitted, np.asarray(target.lengths))
  assert (stats.accepted + stats.iterations == stats.emitted).all()


# ---------------------------------------------------------------------------
# The block contract on our own models (no transformers needed).

@pytest.mark.parametrize("name", ["llama_tiny", "qwen2_tiny", "gpt2_tiny"])
def test_cached_blocks_equal_uncached_forward(name):
  """Ragged prefill, random block sizes, per-row positions, junk rejected tokens."""
  model = load_model(name, seed=1)
  batch, length = 3, 20
  rng = np.random.RandomState(0)
  tokens = rng.randint(3, VOCAB, (batch, length)).astype(np.int32)
  full = np.asarray(model.logits(tokens))

  prompt_lengths = np.array([4, 1, 7], np.int32)
  last, got = score_in_ragged_blocks(model, tokens, prompt_lengths, (1, 3), rng, VOCAB)
  np.testing.assert_allclose(last, full[np.arange(batch), prompt_lengths - 1],
                             rtol=1e-5, atol=1e-5 * np.abs(full).max())
  for b in range(batch):
    real = slice(prompt_lengths[b], length)
    np.testing.assert_allclose(got[b, real], full[b, real], rtol=1e-5,
                               atol=1e-5 * np.abs(full).max())


def _greedy_reference(model, prompts, lengths, steps, eos_id):
  """Step-by-step argmax over the uncached forward pass, one row at a time."""
  width = prompts.shape[1] + steps  # One width, one compile: causality hides later slots.
  rows = []
  for row, n in zip(prompts, lengths):
    seq = np.zeros((1, width), np.int32)
    seq[0, :n] = row[:n]
    out = []
    for t in range(steps):
      token = int(np.asarray(model.logits(seq))[0, n + t - 1].argmax())
      out.append(token)
      seq[0, n + t] = token
      if token == eos_id:
        break
    rows.append(out)
  return rows


def test_temperature_sample_path_equals_stepwise_argmax_with_eos():
  model = load_model("llama_tiny", seed=4)
  # Sharpen the random model so outputs vary and an EOS appears mid-way.
  model = DecoderOnlyModel(model.config, jax.tree_util.tree_map(lambda x: x * 6.0 if x.ndim == 2
                                                                else x, model.params))
  lengths = [3, 6, 1]
  prompts = _random_prompts(lengths, seed=5)
  steps = 10
  ref = _greedy_reference(model, prompts, lengths, steps, eos_id=-1)
  # An EOS that some row emits mid-way exercises early stopping.
  eos = next(r[4] for r in ref if len(set(r[:5])) == 5)
  ref = _greedy_reference(model, prompts, lengths, steps, eos_id=eos)
  out = generate(model, prompts, lengths, max_decode_steps=steps, eos_id=eos)
  assert_matches_rows(out.sequences, ref)
  assert min(np.asarray(out.lengths)) < steps


# ---------------------------------------------------------------------------
# Configs and bad input.

def _tree_shapes(config):
  from specdec_jax.families.decoder_only.network import DecoderOnly
  dummy = jnp.ones((1, 1), jnp.int32)
  shapes = jax.eval_shape(lambda: DecoderOnly(config).init(jax.random.PRNGKey(0), dummy))
  return {k: v.shape for k, v in flatten_dict(shapes["params"], sep="/").items()}


@pytest.mark.parametrize("name", sorted(DECODER_CONFIGS))
def test_named_configs_build_with_their_param_count(name):
  config = DECODER_CONFIGS[name]
  shapes = _tree_shapes(config)
  assert sum(int(np.prod(s)) for s in shapes.values()) == config.num_params


def test_named_config_sizes_match_published_counts():
  # Published parameter counts (HF model cards), to 1%.
  published = {"gpt2": 124.4e6, "gpt2_medium": 354.8e6, "qwen2_0_5b": 494.0e6,
               "qwen2_1_5b": 1543.7e6, "qwen2_7b": 7615.6e6, "llama_2_7b": 6738.4e6,
               "llama_3_2_1b": 1235.8e6, "llama_3_1_8b": 8030.3e6, "tinyllama_1_1b": 1100.0e6}
  for name, count in published.items():
    assert abs(DECODER_CONFIGS[name].num_params / count - 1) < 0.01, name
  assert get_decoder_config("qwen2-0.5b") is DECODER_CONFIGS["qwen2_0_5b"]
  assert get_decoder_config("gpt2-medium").emb_dim == 1024
  with pytest.raises(ValueError, match="gpt2_medium"):
    get_decoder_config("gpt3")


def _write_config(directory, config):
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f)
  return directory


def test_unknown_architecture_is_a_clear_error(tmp_path):
  """The error names what the directory holds and every supported architecture."""
  path = _write_config(tmp_path / "falcon", {"architectures": ["FalconForCausalLM"],
                                             "model_type": "falcon"})
  with pytest.raises(ValueError, match="FalconForCausalLM") as err:
    load_model(path)
  for supported in ("T5ForConditionalGeneration", "LlamaForCausalLM", "GPT2LMHeadModel"):
    assert supported in str(err.value)
  path = _write_config(tmp_path / "bert", {"model_type": "bert"})
  with pytest.raises(CheckpointError, match="'bert'"):
    load_hf_decoder_only(path)
  with pytest.raises(ValueError, match="Unknown model config 'llama_huge'"):
    load_model("llama_huge")


def test_missing_and_misshaped_tensors_are_listed(tmp_path):
  hf = _hf_model("llama_gqa_untied")
  directory = _save(hf, str(tmp_path / "llama"))
  config_path = os.path.join(directory, "config.json")
  with open(config_path) as f:
    config = json.load(f)
  config.update(intermediate_size=100, mlp_bias=True, num_hidden_layers=1)
  _write_config(directory, config)
  with pytest.raises(CheckpointError) as err:
    load_hf_decoder_only(directory)
  message = str(err.value)
  assert "missing (3)" in message and "model.layers.0.mlp.gate_proj.bias" in message
  assert "unexpected (9)" in message and "model.layers.1.mlp.up_proj.weight" in message
  assert "shape mismatch (3)" in message and "model.layers.0.mlp.up_proj.weight" in message


def test_bad_inputs_give_clear_errors():
  model = load_model("llama_tiny")
  prompts = _random_prompts([4, 2], seed=0)
  cache = model.init_cache(2, 3)
  with pytest.raises(ValueError, match="longer than the cache"):
    model.prefill(prompts, [4, 2], cache)
  with pytest.raises(ValueError, match="prompt_lengths must lie in"):
    generate(model, prompts, [0, 2], max_decode_steps=3)
  with pytest.raises(ValueError, match="prompt_lengths must lie in"):
    generate(model, prompts, [5, 2], max_decode_steps=3)
  with pytest.raises(ValueError, match="outside"):
    generate(model, prompts + VOCAB, [4, 2], max_decode_steps=3)
  with pytest.raises(ValueError, match="outside the cache"):
    model.decode_block(np.ones((2, 2), np.int32), np.array([0, 2], np.int32), cache)
  gpt2 = load_model("gpt2_tiny")  # 128 learned positions
  with pytest.raises(ValueError, match="learned positions"):
    generate(gpt2, prompts, [4, 2], max_decode_steps=126)
  with pytest.raises(ValueError, match="learned position table"):
    gpt2.init_cache(1, 129)
  with pytest.raises(ValueError, match="block_width=9"):
    generate(model, prompts, [4, 2], max_decode_steps=3, draft=model, gamma=8, block_width=8)
  small_vocab = load_model("llama_tiny_draft", vocab_size=50)
  with pytest.raises(ValueError, match="vocabulary size 50"):
    generate(model, prompts, [4, 2], max_decode_steps=3, draft=small_vocab)
  import specdec_jax as sj
  t5 = sj.load_model("tiny", vocab_size=VOCAB)
  with pytest.raises(ValueError, match="t5 draft cannot serve a decoder_only target"):
    generate(model, prompts, [4, 2], max_decode_steps=3, draft=t5)


def test_original_gpt2_layout_pytorch_bin(tmp_path, hf_pairs):
  """The hub's original GPT-2 files: pytorch_model.bin, names without `transformer.`,
  causal-mask buffers `h.{i}.attn.bias` stored beside the weights."""
  torch = pytest.importorskip("torch")
  _, hf, model, directory = hf_pairs("gpt2")
  state = {k[len("transformer."):]: v for k, v in hf.state_dict().items()
           if k.startswith("transformer.")}
  state["h.0.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
  old = tmp_path / "gpt2_bin"
  old.mkdir()
  torch.save(state, old / "pytorch_model.bin")
  with open(os.path.join(directory, "config.json")) as f:
    _write_config(old, json.load(f))
  loaded = load_model(old, dtype="float32")
  tokens = _random_prompts([9, 9], seed=8)
  np.testing.assert_array_equal(np.asarray(loaded.logits(tokens)), np.asarray(model.logits(tokens)))


def test_bfloat16_params_and_float32_logits(hf_pairs):
  """dtype='bfloat16': params stored in bf16, logits float32 and close to float32's."""
  _, _, model32, directory = hf_pairs("llama_gqa_untied")
  model16 = load_hf_decoder_only(directory, dtype="bfloat16")
  assert {x.dtype for x in jax.tree_util.tree_leaves(model16.params)} == {jnp.dtype("bfloat16")}
  tokens = _random_prompts([12, 12], seed=9)
  got, want = np.asarray(model16.logits(tokens)), np.asarray(model32.logits(tokens))
  assert got.dtype == np.float32
  # bf16 keeps ~3 significant digits; the argmax mostly survives.
  assert np.abs(got - want).max() < 0.1 * np.abs(want).max()
  assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.8


# ---------------------------------------------------------------------------
# Sampling is exact: chi-square against the target's enumerated distribution.

P_VALUE = 1e-4  # Per-test false-alarm rate (as tests/test_speculative.py).


def _chi_square_pvalue(observed: dict, expected_probs: dict, n: int):
  """Chi-square over outcomes with expected count >= 5 (the rest lumped)."""
  from scipy import stats as scipy_stats
  assert set(observed) <= {k for k, v in expected_probs.items() if v > 0}, (
      "a sample fell on an outcome of probability zero")
  big = [k for k, v in expected_probs.items() if v * n >= 5]
  obs = [observed.get(k, 0) for k in big]
  exp = [expected_probs[k] * n for k in big]
  if n - sum(exp) >= 5:
    obs.append(n - sum(obs))
    exp.append(n - sum(exp))
  obs, exp = np.array(obs, np.float64), np.array(exp, np.float64)
  return scipy_stats.chisquare(obs, exp / exp.sum() * obs.sum(), sum_check=False).pvalue


def _exact_continuations(model, prompt, steps, eos_id, **sampling_kw):
  """P(new tokens) by enumerating every continuation of `prompt` of length `steps`."""
  import collections
  import itertools
  from specdec_jax.core import sampling
  vocab = model.config.vocab_size
  seqs = np.array(list(itertools.product(range(vocab), repeat=steps)), np.int32)
  full = np.concatenate([np.repeat(prompt[None], len(seqs), axis=0), seqs], axis=1)
  logits = model.logits(full)[:, len(prompt) - 1:-1]
  probs = np.asarray(sampling.adjust_probs(logits, **sampling_kw))
  chain = np.prod(np.take_along_axis(probs, seqs[..., None], axis=-1)[..., 0], axis=1)
  dist = collections.defaultdict(float)
  for seq, prob in zip(seqs.tolist(), chain):
    out = []
    for token in seq:  # Output convention: zeros after EOS.
      out.append(0 if eos_id in out else token)
    dist[tuple(out)] += prob
  return dist


# Temperature with top-k, and nucleus sampling; each setting compiles its own
# loop (~10 s), and plain temperature-1 sampling is the same code path untruncated.
@pytest.mark.parametrize("setting", [dict(temperature=0.7, topk=3),
                                     pytest.param(dict(temperature=1.0, topp=0.8),
                                                  marks=pytest.mark.slow)],
                         ids=["t0.7_top3", "topp0.8"])
def test_speculative_samples_follow_target_distribution_ragged_prompts(setting):
  """Two prompts of different lengths in one batch, each row's continuation
  distributed as the target's (llama layout target, noisy-copy draft)."""
  import collections
  vocab, steps, n = 8, 3, 8_000
  base = load_model("llama_tiny", vocab_size=vocab, seed=11, dtype="float32")
  # Sharpen the random init (normal(0.02) gives near-uniform outputs).
  target = DecoderOnlyModel(base.config, jax.tree_util.tree_map(
      lambda x: x * 8.0 if x.ndim == 2 else x, base.params))
  leaves, treedef = jax.tree_util.tree_flatten(target.params)
  keys = jax.random.split(jax.random.PRNGKey(13), len(leaves))
  draft = DecoderOnlyModel(target.config, jax.tree_util.tree_unflatten(
      treedef, [x + 0.1 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]))
  prompts = [np.array([5, 3, 7, 4, 6], np.int32), np.array([3, 6], np.int32)]
  batch = np.zeros((2 * n, 5), np.int32)
  batch[:n] = prompts[0]
  batch[n:, :2] = prompts[1]
  lengths = np.array([5] * n + [2] * n, np.int32)
  out = generate(target, batch, lengths, max_decode_steps=steps, draft=draft,
                              gamma=2, eos_id=2, rng=jax.random.PRNGKey(7), **setting)
  assert 0.02 < out.stats.acceptance_rate < 0.98
  sequences = np.asarray(out.sequences).tolist()
  for rows, prompt in ((sequences[:n], prompts[0]), (sequences[n:], prompts[1])):
    expected = _exact_continuations(target, prompt, steps, eos_id=2, **setting)
    observed = collections.Counter(map(tuple, rows))
    assert len(observed) > 10, "too few distinct outputs to test a distribution"
    assert _chi_square_pvalue(observed, expected, n) > P_VALUE


# ---------------------------------------------------------------------------
# Other drafts for decoder-only targets.

def _sharp_tiny(name, seed, scale=6.0):
  model = load_model(name, seed=seed)
  return DecoderOnlyModel(model.config, jax.tree_util.tree_map(
      lambda x: x * scale if x.ndim == 2 else x, model.params))


def test_greedy_with_ngram_adaptive_and_confident_drafts_equals_target():
  from specdec_jax.drafts import AdaptiveGammaDraft, NgramDraft
  from specdec_jax.drafts import ModelDraft
  from specdec_jax.drafts import PromptLookupDraft
  target = _sharp_tiny("qwen2_tiny", seed=5)
  small = _sharp_tiny("llama_tiny_draft", seed=6)
  lengths = [6, 2, 9]
  prompts = _random_prompts(lengths, seed=10)
  steps = 10
  want = generate(target, prompts, lengths, max_decode_steps=steps, eos_id=-1)
  # The bigram is fitted on the target's own outputs: it is often right.
  bigram = NgramDraft.fit(np.asarray(want.sequences), VOCAB, order=2, smoothing=0.1,
                          eos_id=EOS, pad_id=0)
  # One compile each: the generic Draft path (bigram, prompt lookup), and the
  # model draft under the adaptive schedule with a confidence threshold.
  drafts = {"bigram": bigram, "prompt_lookup": PromptLookupDraft(VOCAB),
            "adaptive_confident_small": AdaptiveGammaDraft(
                ModelDraft(small, confidence_threshold=0.3))}
  for name, draft in drafts.items():
    out = generate(target, prompts, lengths, max_decode_steps=steps, eos_id=-1,
                                draft=draft, gamma=3)
    np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(want.sequences),
                                  err_msg=name)
    assert (out.stats.accepted + out.stats.iterations == steps).all(), name
    assert out.stats.drafted.sum() > 0, name
  assert out.stats.drafted.sum() < 3 * out.stats.iterations.sum(), "drafts never cut short"


def test_drafts_of_the_wrong_family_are_clear_errors():
  import specdec_jax as sj
  from specdec_jax.drafts import AdaptiveGammaDraft, ModelDraft
  target = load_model("llama_tiny")
  prompts = _random_prompts([3, 2], seed=0)
  t5 = sj.load_model("tiny", vocab_size=VOCAB)
  for draft in (t5, ModelDraft(t5), AdaptiveGammaDraft(t5)):
    with pytest.raises(ValueError, match="t5 draft cannot serve a decoder_only target"):
      generate(target, prompts, [3, 2], max_decode_steps=3, draft=draft)
  with pytest.raises(TypeError, match="draft must be a model or a specdec_jax Draft"):
    generate(target, prompts, [3, 2], max_decode_steps=3, draft="gpt2")
  # The reverse: decoder-only drafts for a T5 target.
  for draft in (target, ModelDraft(target)):
    with pytest.raises(ValueError, match="decoder_only draft cannot serve a t5 target"):
      sj.generate(t5, prompts, max_decode_steps=3, draft=draft)


def test_prompt_lookup_reads_a_continued_context_from_prompt_and_output():
  from specdec_jax.drafts import PromptLookupDraft
  from specdec_jax.families.base import Context
  draft = PromptLookupDraft(VOCAB, max_ngram=3)
  prompts = jnp.array([[5, 6, 7, 8, 5, 6], [9, 4, 0, 0, 0, 0], [11, 12, 13, 0, 0, 0]])
  context = Context(prompts, jnp.array([6, 2, 3]), continued=True)
  # The loop's sequences: last prompt token, then generated tokens.
  sequences = jnp.array([[6, 0, 0, 0, 0], [4, 3, 9, 4, 0], [13, 14, 0, 0, 0]])
  lengths = jnp.array([0, 3, 1])
  haystack, valid, end, _ = draft.haystack(context, sequences, lengths)
  assert np.asarray(end).tolist() == [6, 5, 4]
  assert np.asarray(haystack)[1, :5].tolist() == [9, 4, 3, 9, 4]
  assert np.asarray(valid).sum(axis=1).tolist() == [6, 5, 4]
  propose = draft.proposer((), sj.ProposalPlan(sj.Sampling(), 3, 4)).propose
  tokens, probs, num_drafted, _ = propose(None, context, sequences, lengths)
  # Row 0: [5, 6] (the prompt's tail) recurs at 0 -> 7, 8, 5. Row 1: [9, 4]
  # spans prompt and output, recurs at 0 -> 3, 9, 4. Row 2: 14 never occurred.
  assert np.asarray(tokens).tolist() == [[7, 8, 5], [3, 9, 4], [0, 0, 0]]
  assert np.asarray(num_drafted).tolist() == [3, 3, 0]
  np.testing.assert_array_equal(np.asarray(probs).argmax(-1)[:2], np.asarray(tokens)[:2])
  assert np.asarray(probs)[2].sum() == 0


# config.json files as the hub ships them (transformers 4 format: top-level
# rope_theta / rope_scaling), abridged to the fields that matter here.
_HUB_CONFIGS = {
    "llama_3_2_1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 16,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256},
    "qwen2_0_5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "eos_token_id": 151643,
        "hidden_act": "silu", "hidden_size": 896, "intermediate_size": 4864,
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "use_sliding_window": False, "vocab_size": 151936},
    "gpt2": {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "activation_function": "gelu_new", "bos_token_id": 50256, "eos_token_id": 50256,
        "layer_norm_epsilon": 1e-05, "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
        "n_positions": 1024, "vocab_size": 50257},
}


@pytest.mark.parametrize("name", sorted(_HUB_CONFIGS))
def test_hub_config_json_parses_to_the_named_config(name):
  import dataclasses
  from specdec_jax.families.decoder_only.checkpoints import hf_config_to_decoder_config
  parsed = hf_config_to_decoder_config(_HUB_CONFIGS[name])
  named = get_decoder_config(name, dtype="float32")
  # pad_id only fills prompt padding; Qwen2's context length and BOS are not
  # in the abridged file.
  ignored = {"pad_id", "max_positions", "bos_id"} if name == "qwen2_0_5b" else {"pad_id"}
  for field in dataclasses.fields(named):
    if field.name not in ignored:
      assert getattr(parsed, field.name) == getattr(named, field.name), field.name


@pytest.mark.parametrize("name", ["llama_tiny", "qwen2_tiny", "gpt2_tiny"])
def test_export_hf_round_trip(name, tmp_path):
  """Our model -> HF directory: transformers reproduces our logits; we reload it exactly."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from specdec_jax.families.decoder_only.checkpoints import export_hf_decoder_only
  model = _sharp_tiny(name, seed=3, scale=4.0)
  if name == "llama_tiny":  # Cover Llama 3.1 rotary scaling in the exported config too.
    model = DecoderOnlyModel(model.config.replace(rope_scaling="llama3", rope_factor=4.0,
                                                  rope_original_max_positions=32),
                             model.params)
  export_hf_decoder_only(model, tmp_path)
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  tokens = _random_prompts([13, 13], seed=4)
  with torch.no_grad():
    want = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(np.asarray(model.logits(tokens)), want, atol=1e-4, rtol=0)
  again = load_hf_decoder_only(tmp_path, dtype="float32")
  assert again.config == model.config.replace(pad_id=again.config.pad_id)
  for a, b in zip(jax.tree_util.tree_leaves(again.params), jax.tree_util.tree_leaves(model.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="Qwen2 has q/k/v biases only"):
    export_hf_decoder_only(DecoderOnlyModel(model.config.replace(family="qwen2", qkv_bias=False),
                                            model.params), tmp_path / "bad")


def test_hub_ids_download_or_fail_clearly(monkeypatch, hf_pairs):
  hub = pytest.importorskip("huggingface_hub")
  _, _, model, directory = hf_pairs("gpt2")

  def offline(*args, **kwargs):
    raise ConnectionError("offline")

  monkeypatch.setattr(hub, "snapshot_download", offline)
  with pytest.raises(FileNotFoundError, match="could not be fetched"):
    load_model("someone/gpt2-not-here")
  monkeypatch.setattr(hub, "snapshot_download", lambda repo_id, **kwargs: directory)
  fetched = load_model("someone/gpt2-cached", dtype="float32")
  assert fetched.config == model.config


# ---------------------------------------------------------------------------
# Training and distillation losses with specdec_jax.train.trainer.

def test_causal_lm_loss_and_training_steps():
  from specdec_jax.train import trainer as train
  from specdec_jax.families.decoder_only.batch import lm_batch
  model = load_model("llama_tiny_draft", seed=0)
  rng = np.random.RandomState(0)
  sequences = rng.randint(3, VOCAB, (4, 12)).astype(np.int32)
  batch = lm_batch(sequences, lengths=[12, 9, 12, 5], prompt_lengths=[3, 1, 0, 2])
  assert batch["weights"][1].tolist() == [0] + [1] * 8 + [0] * 3
  loss_fn = train.loss_fn(model.config)
  loss, aux = loss_fn(model.params, batch)
  # The same number from the uncached forward pass.
  logits = np.asarray(model.logits(sequences))[:, :-1]
  log_probs = jax.nn.log_softmax(logits)
  nll = -np.take_along_axis(np.asarray(log_probs), sequences[:, 1:, None], axis=-1)[..., 0]
  np.testing.assert_allclose(float(loss), float((nll * batch["weights"][:, 1:]).sum()),
                             rtol=1e-5)
  assert float(aux["tokens"]) == batch["weights"][:, 1:].sum()
  optimizer = train.make_optimizer("adamw", 3e-3)
  state = train.create_train_state(model.params, optimizer)
  step = jax.jit(lambda s, b: train.train_step(s, b, loss_fn=loss_fn, optimizer=optimizer))
  first = None
  for _ in range(30):
    state, metrics = step(state, batch)
    first = float(metrics["loss"]) if first is None else first
  assert float(metrics["loss"]) < 0.5 * first, "memorising one batch must be easy"


def test_causal_distillation_raises_agreement():
  from specdec_jax.train import distill
  from specdec_jax.train import trainer as train
  from specdec_jax.families.decoder_only.batch import lm_batch
  target = _sharp_tiny("llama_tiny", seed=1, scale=4.0)
  draft = load_model("llama_tiny_draft", seed=2)
  out = generate(target, _random_prompts([4] * 8, seed=3), max_decode_steps=12,
                              temperature=1.0, eos_id=-1)
  sequences = np.concatenate([_random_prompts([4] * 8, seed=3), np.asarray(out.sequences)], 1)
  batch = lm_batch(sequences, lengths=[16] * 8, prompt_lengths=[4] * 8)
  batch["teacher_probs"] = distill.teacher_probs(target, batch, temperature=1.0)
  loss_fn = distill.distill_loss_fn({"draft": draft.config}, "tv", temperature=1.0)
  optimizer = train.make_optimizer("adamw", 3e-3)
  state = train.create_train_state({"draft": draft.params}, optimizer)
  step = jax.jit(lambda s, b: train.train_step(s, b, loss_fn=loss_fn, optimizer=optimizer))
  first = None
  for _ in range(40):
    state, metrics = step(state, batch)
    first = float(metrics["loss"]) if first is None else first
  # TV = 1 - beta per token: distillation raises the acceptance probability.
  assert float(metrics["loss"]) < 0.7 * first
  with pytest.raises(ValueError, match="unknown divergence"):
    distill.distill_loss_fn({"draft": draft.config}, "reverse_kl", temperature=1.0)


def test_distill_decoder_only_drafts_raises_alpha():
  from specdec_jax import data
  from specdec_jax.train import distill
  target = _sharp_tiny("llama_tiny", seed=1, scale=4.0)
  draft = load_model("llama_tiny_draft", seed=2)
  rng = np.random.RandomState(5)
  lengths = rng.randint(2, 7, 48)
  prompts = _random_prompts(lengths.tolist(), seed=6)
  result = distill.distill_drafts(
      target, {"small": draft}, data.Prompts(prompts[:32], lengths[:32]), steps=40,
      batch_size=16, learning_rate=3e-3, optimizer="adamw", divergence="tv",
      max_decode_steps=10, eval_prompts=data.Prompts(prompts[32:], lengths[32:]),
      alpha_temperatures=(0.0,), gamma=3, progress_bar=False)
  assert result.loss_last < 0.7 * result.loss_first
  # Measured: greedy alpha 0.04 -> 0.17 on the held-out prompts.
  before, after = result.alpha_before["small"][0.0], result.alpha_after["small"][0.0]
  assert after > max(2 * before, before + 0.05), result


def test_bfloat16_greedy_speculative_equals_target_only():
  """With one target block width in both loops, bf16 rounding cannot split them."""
  target = load_model("qwen2_tiny", seed=7, dtype="bfloat16")
  target = DecoderOnlyModel(target.config, jax.tree_util.tree_map(
      lambda x: x * 6 if x.ndim == 2 else x, target.params))
  leaves, treedef = jax.tree_util.tree_flatten(target.params)
  keys = jax.random.split(jax.random.PRNGKey(8), len(leaves))
  draft = DecoderOnlyModel(target.config, jax.tree_util.tree_unflatten(treedef, [
      (x + 0.01 * jax.random.normal(k, x.shape)).astype(x.dtype) for x, k in zip(leaves, keys)]))
  lengths = [7, 3, 5, 1]
  prompts = _random_prompts(lengths, seed=11)
  want = generate(target, prompts, lengths, max_decode_steps=12, eos_id=-1)
  got = generate(target, prompts, lengths, max_decode_steps=12, eos_id=-1,
                              draft=draft, gamma=3)
  np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(want.sequences))
  assert 0 < got.stats.acceptance_rate < 1


def test_lm_windows_cut_a_tokenized_corpus():
  from specdec_jax import data
  texts = ["def f(x):\n    return x + 1\n" * 20, "import os\nprint(os.sep)\n" * 20]
  tokenizer = data.Tokenizer(data.train_tokenizer(
      (line for t in texts for line in t.splitlines(keepends=True)), 300))
  windows = data.lm_windows(texts, tokenizer, 16, eos_id=data.EOS_ID)
  stream = [t for text in texts for t in tokenizer.encode_lines(text) + [data.EOS_ID]]
  assert windows.shape == (len(stream) // 16, 16) and windows.dtype == np.int32
  assert windows.reshape(-1).tolist() == stream[:windows.size]
  assert tokenizer.decode(windows[0]) == texts[0][:len(tokenizer.decode(windows[0]))]
  with pytest.raises(ValueError, match="fewer than one window"):
    data.lm_windows(["x"], tokenizer, 64, eos_id=data.EOS_ID)
