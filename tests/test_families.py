"""One engine for every model family: the registry, `load_model` / `generate` dispatch,
and a toy family, defined here, decoding speculatively through the unchanged engine.

The toy family is what a new family must implement (`families/base.py`): a
config type, a model type, parameters, how a decode starts, the block
callback, the drafts' context, teacher-forced logits, logical axes and a
checkpoint check. Nothing in `core/`, `drafts/`, `generation.py`,
`loading.py` or `sharding.py` knows it exists.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.families.base import Context, DecodeStart, Family, check_tokens
from specdec_jax.tools import testing


def test_load_model_dispatches_on_names_and_configs():
  assert isinstance(sj.load_model("tiny"), sj.Model)
  assert isinstance(sj.load_model("llama_tiny", dtype="float32"), sj.DecoderOnlyModel)
  assert isinstance(sj.load_model(sj.get_decoder_config("gpt2_tiny")), sj.DecoderOnlyModel)
  with pytest.raises(ValueError, match="Unknown model config 'no_such_model'.*t5:.*decoder_only:"):
    sj.load_model("no_such_model")


def test_registry_finds_each_family():
  assert sj.family_of(sj.load_model("tiny")).name == "t5"
  assert sj.family_of(sj.get_decoder_config("gpt2_tiny")).name == "decoder_only"
  assert [f.name for f in sj.families()][:2] == ["t5", "decoder_only"]
  with pytest.raises(TypeError, match="not a model of a registered family"):
    sj.family_of("gpt2")


def test_load_model_reads_a_decoder_only_hf_directory(tmp_path):
  model = sj.load_model("qwen2_tiny", dtype="float32", seed=3)
  sj.export_hf(model, str(tmp_path))
  loaded = sj.load_model(str(tmp_path), dtype="float32")
  assert isinstance(loaded, sj.DecoderOnlyModel) and loaded.config == model.config
  for a, b in zip(jax.tree_util.tree_leaves(model.params), jax.tree_util.tree_leaves(loaded.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

@pytest.mark.slow  # make test budget; runs in make test-slow

def test_generate_runs_decoder_only_targets_and_drafts():
  target = sj.load_model("llama_tiny", dtype="float32", seed=1)
  draft = sj.load_model("llama_tiny_draft", dtype="float32", seed=2)
  prompts = np.array([[5, 6, 7, 8, 0], [9, 10, 0, 0, 0]], np.int32)
  lengths = np.array([4, 2], np.int32)
  plain = sj.generate(target, prompts, lengths, max_decode_steps=6)
  for d in (draft, sj.ModelDraft(draft, confidence_threshold=0.2)):
    spec = sj.generate(target, prompts, lengths, max_decode_steps=6, draft=d, gamma=3)
    np.testing.assert_array_equal(np.asarray(spec.sequences), np.asarray(plain.sequences))
  rows = sj.generate(target, prompts, lengths, max_decode_steps=6, batch_invariant=True)
  alone = sj.generate(target, prompts[1:], lengths[1:], max_decode_steps=6)
  np.testing.assert_array_equal(np.asarray(rows.sequences)[1], np.asarray(alone.sequences)[0])


def test_mixing_families_is_a_clear_error():
  t5_target, _ = testing.tiny_pair(vocab_size=32)
  gpt = sj.load_model("gpt2_tiny", dtype="float32", vocab_size=32)
  enc = testing.random_encoder_tokens(1, 4, 32)
  with pytest.raises(ValueError, match="decoder_only draft cannot serve a t5 target"):
    sj.generate(t5_target, enc, max_decode_steps=3, draft=gpt)
  with pytest.raises(ValueError, match="t5 draft cannot serve a decoder_only target"):
    sj.generate(gpt, enc, max_decode_steps=3, draft=t5_target)
  with pytest.raises(ValueError, match="prompt_lengths"):
    sj.generate(t5_target, enc, np.array([2]), max_decode_steps=3)


# ---------------------------------------------------------------------------
# A toy family: a causal "running mean" language model. The hidden state at
# position t is the mean of the token embeddings at positions 0..t; logits =
# tanh(hidden) @ out. Its cache holds each position's embedding.

@dataclasses.dataclass(frozen=True)
class ToyConfig:
  vocab_size: int = 12
  emb_dim: int = 8
  eos_id: int = 1
  pad_id: int = 0
  dtype: str = "float32"

  def replace(self, **changes):
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True, eq=False)
class ToyModel:
  config: ToyConfig
  params: dict


def _toy_logits(params, embeddings, mask):
  """embeddings [b, L, E], mask [b, k, L] (query sees key) -> logits [b, k, V] float32."""
  weights = mask / jnp.sum(mask, axis=-1, keepdims=True)
  hidden = jnp.einsum("bkl,ble->bke", weights, embeddings)
  return (jnp.tanh(hidden) @ params["out"]).astype(jnp.float32)


class ToyFamily(Family):
  name = "toy"
  config_type = ToyConfig
  model_type = ToyModel
  architectures = ("none (a test family)",)

  def named_configs(self):
    return {"toy_small": ToyConfig(), "toy_draft": ToyConfig(emb_dim=4)}

  def init_params(self, config, seed=0):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return dict(embedding=jax.random.normal(k1, (config.vocab_size, config.emb_dim)),
                out=3.0 * jax.random.normal(k2, (config.emb_dim, config.vocab_size)))

  def abstract_params(self, config):
    return jax.eval_shape(lambda: self.init_params(config))

  def check_inputs(self, config, tokens, lengths, max_decode_steps):
    tokens = check_tokens(tokens, "prompts")
    lengths = (np.full(tokens.shape[0], tokens.shape[1]) if lengths is None else
               np.asarray(lengths))
    if lengths.min() < 1 or lengths.max() > tokens.shape[1]:
      raise ValueError("toy prompt lengths must lie in [1, width]")
    return tokens, jnp.asarray(lengths, jnp.int32)

  def context(self, tokens, lengths):
    return Context(tokens, lengths, continued=True)

  def cache_length(self, config, context_width, max_decode_steps):
    return context_width + max_decode_steps - 1

  def start(self, config, params, tokens, lengths, max_decode_steps):
    length = self.cache_length(config, tokens.shape[1], max_decode_steps)
    cache = jnp.zeros((tokens.shape[0], length, config.emb_dim))
    cache = cache.at[:, :tokens.shape[1]].set(params["embedding"][tokens])
    return DecodeStart(cache, tokens[jnp.arange(tokens.shape[0]), lengths - 1], lengths - 1)

  def block_fn(self, config, params):
    def block(tokens, positions, cache):
      k, length = tokens.shape[1], cache.shape[1]
      index = positions[:, None] + jnp.arange(k)            # [b, k] absolute positions
      rows = jnp.arange(tokens.shape[0])[:, None]
      # Writes past the cache's end (a padded block's tail) are dropped.
      cache = cache.at[rows, index].set(params["embedding"][tokens], mode="drop")
      mask = (jnp.arange(length)[None, None] <= index[..., None]).astype(jnp.float32)
      return _toy_logits(params, cache, mask), cache
    return block

  def token_logits(self, config, params, batch):
    tokens = batch["tokens"]
    length = tokens.shape[1] - 1
    mask = jnp.tril(jnp.ones((length, length)))[None].repeat(tokens.shape[0], 0)
    logits = _toy_logits(params, params["embedding"][tokens[:, :-1]], mask)
    return logits, tokens[:, 1:], batch["weights"][:, 1:]

  def continuation_batch(self, config, tokens, lengths, sequences, sequence_lengths):
    # Prompt then continuation in one row, as decoder-only families do.
    rows = [np.concatenate([t[:n], s[:m]]) for t, n, s, m in
            zip(np.asarray(tokens), np.asarray(lengths), np.asarray(sequences),
                np.asarray(sequence_lengths))]
    width = tokens.shape[1] + sequences.shape[1]
    batch = np.zeros((len(rows), width), np.int32)
    weights = np.zeros((len(rows), width), np.float32)
    for i, (row, n) in enumerate(zip(rows, np.asarray(lengths))):
      batch[i, :len(row)] = row
      weights[i, n:len(row)] = 1.0
    return dict(tokens=batch, weights=weights)

  def param_logical_axes(self, path, ndim):
    return {"embedding": ("vocab", "embed"), "out": ("embed", "vocab")}[path[-1]]

  def cache_logical_axes(self, cache):
    return ("batch", "length", "embed")

  def abstract_cache(self, config, batch, context_width, max_decode_steps):
    return jax.ShapeDtypeStruct(
        (batch, self.cache_length(config, context_width, max_decode_steps), config.emb_dim),
        jnp.float32)

  def detect(self, path):
    return False

  def load(self, path, *, dtype=None, place=None, **options):
    raise ValueError("the toy family has no checkpoint format")


TOY = sj.register(ToyFamily())


def _reference_greedy(model, prompt, steps):
  """Greedy continuation of one prompt by teacher-forced logits over the whole prefix."""
  tokens = list(prompt)
  for _ in range(steps):
    batch = dict(tokens=jnp.asarray([tokens + [0]], jnp.int32),
                 weights=jnp.ones((1, len(tokens) + 1)))
    logits, _, _ = TOY.token_logits(model.config, model.params, batch)
    tokens.append(int(jnp.argmax(logits[0, -1])))
  return tokens[len(prompt):]


def test_a_toy_family_decodes_speculatively_through_the_unchanged_engine():
  target = sj.load_model("toy_small", seed=1)
  draft = sj.load_model(ToyConfig(emb_dim=4), seed=2)
  assert isinstance(target, ToyModel) and sj.family_of(target) is TOY
  prompts = np.array([[3, 4, 5, 6], [7, 8, 0, 0], [2, 9, 10, 0]], np.int32)
  lengths = np.array([4, 2, 3], np.int32)
  steps = 7
  plain = sj.generate(target, prompts, lengths, max_decode_steps=steps, eos_id=-1)
  want = [_reference_greedy(target, p[:n].tolist(), steps) for p, n in zip(prompts, lengths)]
  np.testing.assert_array_equal(np.asarray(plain.sequences), np.asarray(want))
  ngram = sj.NgramDraft.fit(np.asarray(want), vocab_size=12, smoothing=0.1)
  for d in (draft, sj.ModelDraft(draft, confidence_threshold=0.5), ngram,
            sj.PromptLookupDraft(12), sj.AdaptiveGammaDraft(draft)):
    spec = sj.generate(target, prompts, lengths, max_decode_steps=steps, eos_id=-1, draft=d,
                       gamma=3)
    np.testing.assert_array_equal(np.asarray(spec.sequences), np.asarray(want))
    assert (spec.stats.accepted + spec.stats.iterations == steps).all()
  # A draft of another family is refused by name.
  with pytest.raises(ValueError, match="decoder_only draft cannot serve a toy target"):
    sj.generate(target, prompts, lengths, max_decode_steps=3,
                draft=sj.load_model("llama_tiny", vocab_size=12))


def test_a_toy_family_samples_and_plans_memory_through_the_engine():
  target = sj.load_model("toy_small", seed=1)
  draft = sj.load_model("toy_draft", seed=2)
  prompts = np.array([[3, 4, 5, 6]] * 4, np.int32)
  out = sj.generate(target, prompts, max_decode_steps=5, eos_id=-1, draft=draft, gamma=2,
                    temperature=1.0, rng=jax.random.PRNGKey(3))
  assert out.sequences.shape == (4, 5) and out.stats.drafted.sum() > 0
  plan = sj.plan_memory(target.config, batch=2, context_len=4, max_decode_len=5,
                        mesh_shape="1,1")
  assert plan.params_bytes == 4 * (12 * 8 * 2) and plan.cache_bytes == 4 * 2 * 8 * 8
