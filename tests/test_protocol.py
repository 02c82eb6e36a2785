"""The proposer protocol (drafts/base.py): a draft written from docs/drafts.md alone, outside
the package, is exact; declared needs are served or refused by name before any work."""

import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sj
from specdec_jax.families.base import Family
from specdec_jax.families.decoder_only.family import DecoderOnlyFamily

DOCS = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "drafts.md")
PAIRS = (None, "demo_pair_decoder_only")


def _docs_module(tmp_path):
  """The complete draft of docs/drafts.md, written to a file outside the package and imported."""
  text = open(DOCS).read()
  section = text[text.index("## A complete draft in one file"):]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  assert len(code.strip().splitlines()) <= 40, "the docs promise a 40-line draft"
  path = tmp_path / "accepted_counts.py"
  path.write_text(code)
  spec = importlib.util.spec_from_file_location("accepted_counts", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def docs_draft(tmp_path_factory):
  return _docs_module(tmp_path_factory.mktemp("outside"))


@pytest.mark.parametrize("path", PAIRS, ids=["t5", "decoder_only"])
def test_the_docs_draft_is_exact(docs_draft, path):
  pair = sj.load_demo_pair(path)
  tokens, lengths = pair.inputs(2)
  config = pair.target.config
  draft = docs_draft.AcceptedCountsDraft(config.vocab_size, config.eos_id, config.pad_id)
  kwargs = dict(max_decode_steps=16, block_width=4)
  expected = sj.generate(pair.target, tokens, lengths, **kwargs)
  variants = [(draft, {})]
  if path is not None:  # the wrappers once, on the cheaper pair (compiles dominate)
    variants += [(sj.AdaptiveGammaDraft(draft), {}), (draft, dict(verification="block"))]
  for wrapped, options in variants:
    out = sj.generate(pair.target, tokens, lengths, draft=wrapped, gamma=3, **kwargs, **options)
    np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(expected.sequences))
    assert out.stats.iterations.sum() > 0
  if path is None:
    # Sampled: it runs, one law for draft and target (distributions: the verifiers' tests).
    out = sj.generate(pair.target, tokens, lengths, draft=draft, gamma=3, temperature=1.0,
                      rng=jax.random.PRNGKey(3), **kwargs)
    assert out.sequences.shape == (2, 16)
  assert draft.calls_per_proposal(3) == 1


class _CacheReadingDraft(sj.PromptLookupDraft):
  """Prompt lookup that also declares it reads the target's cache, and checks it got it."""
  reads = sj.Reads(cache=True)

  def proposer(self, params, plan):
    chain = super().proposer(params, plan)

    def propose(rng, state, sequences, lengths, max_drafted=None, target_cache=None):
      assert target_cache is not None and jax.tree_util.tree_leaves(target_cache)
      return chain.propose(rng, state, sequences, lengths, max_drafted)

    return chain._replace(propose=propose, reads_cache=True)


def test_a_draft_that_reads_the_target_cache_gets_it():
  pair = sj.load_demo_pair("demo_pair_decoder_only")
  tokens, lengths = pair.inputs(2)
  kwargs = dict(max_decode_steps=12, block_width=4)
  expected = sj.generate(pair.target, tokens, lengths, **kwargs)
  draft = _CacheReadingDraft(pair.target.config.vocab_size)
  out = sj.generate(pair.target, tokens, lengths, draft=draft, gamma=3, **kwargs)
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(expected.sequences))


def test_an_adaptive_feature_draft_forwards_the_features():
  pair = sj.load_demo_pair("demo_pair_decoder_only")
  tokens, lengths = pair.inputs(2)
  kwargs = dict(max_decode_steps=16, block_width=5)
  expected = sj.generate(pair.target, tokens, lengths, **kwargs)
  draft = sj.AdaptiveGammaDraft(pair.drafts["feature"])
  assert draft.reads == pair.drafts["feature"].reads
  out = sj.generate(pair.target, tokens, lengths, draft=draft, gamma=4, **kwargs)
  np.testing.assert_array_equal(np.asarray(out.sequences), np.asarray(expected.sequences))
  assert out.stats.alpha > 0.5, out.stats.summary()


class _NoFeatures(DecoderOnlyFamily):
  """A family that exposes no hidden states (never registered)."""
  name = "no_features"
  supports_features = False
  feature_dim = Family.feature_dim


def test_needs_the_family_cannot_serve_are_refused_by_name():
  pair = sj.load_demo_pair("demo_pair_decoder_only")
  config = pair.target.config
  with pytest.raises(ValueError, match="no_features family does not expose its hidden states"):
    sj.target_features().check_served(_NoFeatures(), config)
  sj.Reads(cache=True).check_served(_NoFeatures(), config)  # every family has a cache

  class _DeepFeatures(sj.PromptLookupDraft):
    reads = sj.target_features((config.num_layers + 5,))

  tokens, lengths = pair.inputs(1)
  with pytest.raises(ValueError, match="feature layers"):
    sj.generate(pair.target, tokens, lengths, max_decode_steps=4,
                draft=_DeepFeatures(config.vocab_size))


def test_the_protocol_names_what_a_draft_must_define():
  class Half(sj.Draft):
    vocab_size = 8
    params = ()

    def static_key(self):
      return "half"

  with pytest.raises(TypeError, match="init_state.*proposer|proposer.*init_state"):
    Half()
  with pytest.raises(TypeError, match="varies a chain's length"):
    sj.AdaptiveGammaDraft(sj.TreeDraft(sj.NgramDraft(np.ones(8)), (2,)))


def test_settings_are_validated_once_for_every_entry_point():
  config = sj.load_demo_pair("demo_pair_decoder_only").target.config
  settings = sj.plan_settings(config, None, max_decode_steps=8)
  assert settings.sampling.greedy and settings.gamma == 0 and settings.block_width >= 1
  assert sj.Sampling(1, 0, 0) == sj.Sampling(1.0, 0, 0.0)  # one compile for both spellings
  with pytest.raises(ValueError, match="topk .* and topp .* are exclusive"):
    sj.Sampling(1.0, 3, 0.5)
  with pytest.raises(ValueError, match="gamma must be an int >= 1"):
    sj.plan_settings(config, sj.PromptLookupDraft(config.vocab_size), max_decode_steps=8,
                     gamma=0)
  with pytest.raises(ValueError, match="applies to speculative decoding"):
    sj.plan_settings(config, None, max_decode_steps=8, verification="block")
  probs = sj.Sampling(0.0).probs(jnp.array([[0.1, 2.0, 1.0]]))
  np.testing.assert_array_equal(np.asarray(probs), [[0.0, 1.0, 0.0]])
