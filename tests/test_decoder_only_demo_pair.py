"""The shipped decoder-only demo pair (demo_pair_decoder_only/): it loads, greedy
speculative decoding with its drafts equals target-only decoding on held-out
prompts of different lengths, and the distilled draft beats the unigram on alpha."""

import os

import jax
import numpy as np
import pytest

from specdec_jax import data
from specdec_jax.demo_pair import DIRS, load_demo_pair
from specdec_jax.drafts import ModelDraft
from specdec_jax.generation import generate

DEFAULT_DIR = DIRS["decoder_only"]
SHIPPED = os.path.exists(os.path.join(DEFAULT_DIR, "info.json"))
needs_pair = pytest.mark.skipif(
    not SHIPPED, reason="demo_pair_decoder_only/ not trained yet "
    "(python -m experiments.train_decoder_only_pair)")
NUM_PROMPTS = 8
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def pair():
  return load_demo_pair("decoder_only")


@pytest.fixture(scope="module")
def greedy_runs(pair):
  """Target-only and speculative greedy outputs on the first NUM_PROMPTS held-out prompts."""
  prompts, lengths = pair.inputs(NUM_PROMPTS)
  runs = {None: generate(pair.target, prompts, lengths, max_decode_steps=NEW_TOKENS)}
  for name, draft in (("draft", ModelDraft(pair.drafts["draft"])),
                      ("unigram", pair.ngrams["unigram"])):
    runs[name] = generate(pair.target, prompts, lengths, max_decode_steps=NEW_TOKENS,
                          draft=draft, gamma=4)
  return runs


@needs_pair
def test_pair_loads(pair):
  # The distilled draft, then the trained heads where they ship (test_feature_training.py).
  assert pair.family == "decoder_only" and list(pair.drafts)[0] == "draft"
  assert set(pair.drafts) <= {"draft", "feature", "medusa", "dflash", "parallel"}
  target, draft = pair.target.config, pair.drafts["draft"].config
  assert (target.family, draft.family) == ("gpt2", "gpt2")
  assert target.vocab_size == draft.vocab_size == pair.tokenizer.vocab_size == 2048
  assert target.tie_word_embeddings and target.eos_id == data.EOS_ID
  assert draft.num_params * 5 < target.num_params
  leaves = jax.tree_util.tree_leaves(pair.target.params)
  assert all(x.dtype == np.float32 for x in leaves)
  prompts, lengths = pair.inputs()
  n, width = prompts.shape
  assert pair.max_decode_steps == pair.info["settings"]["new_tokens"]
  assert lengths.shape == (n,) and pair.references().shape == (n, pair.max_decode_steps)
  assert 1 <= lengths.min() < lengths.max() <= width
  assert width + pair.max_decode_steps - 1 <= target.max_positions
  # Every prompt comes from a file the models never trained on.
  percent = pair.info["settings"]["heldout_percent"]
  assert all(data.is_heldout(row["path"], percent) for row in pair.heldout)
  with pytest.raises(ValueError, match="lengths"):
    pair.heldout_inputs(2)  # prompts without their lengths would decode the padding
  assert set(pair.info["stats"]["alpha"]["alpha"]) >= {"draft", "bigram", "unigram"}


@needs_pair
def test_shipped_pair_fits_the_budget():
  total = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(DEFAULT_DIR)
              for f in files)
  # 9.3 MB with the models, n-grams and feature / Medusa heads; the DFlash and PARD
  # drafters (issue 32) add 2.3 MB.
  assert total <= 12.5e6, f"demo_pair_decoder_only/ is {total / 1e6:.1f} MB"


def test_missing_pair_names_the_training_command(tmp_path):
  with pytest.raises(FileNotFoundError, match="train_decoder_only_pair"):
    load_demo_pair(str(tmp_path))


@needs_pair
def test_greedy_speculative_equals_target_only(greedy_runs):
  reference = np.asarray(greedy_runs[None].sequences)
  for name in ("draft", "unigram"):
    np.testing.assert_array_equal(np.asarray(greedy_runs[name].sequences), reference,
                                  err_msg=f"greedy speculative with {name} != target-only")
  # The trained target continues code, not a constant token.
  assert len(np.unique(reference)) > 10


@needs_pair
def test_distilled_draft_alpha_above_unigram(greedy_runs):
  alpha = {name: float(greedy_runs[name].stats.beta_sum.sum() /
                       greedy_runs[name].stats.beta_count.sum()) for name in ("draft", "unigram")}
  assert alpha["draft"] > alpha["unigram"] + 0.2, alpha
