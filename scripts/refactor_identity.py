r"""Outputs of every draft kind on both demo pairs, for comparing two checkouts bit for bit.

Decodes the first held-out rows of both demo pairs through the public API
only (`sj.generate` and the draft classes), greedy and sampled with fixed
keys, in float32 and bfloat16, at every draft kind a pair ships or the
package builds around it (model drafts, n-gram, prompt lookup, adaptive
length, static and dynamic trees, block verification, feature head and
Medusa heads, chain and tree), and writes every decode's tokens and
lengths to one .npz. Run it in each checkout, then compare:

  git worktree add /tmp/base <commit>
  PYTHONPATH=/tmp/base JAX_PLATFORMS=cpu python scripts/refactor_identity.py \
      --output=/tmp/identity_base.npz
  JAX_PLATFORMS=cpu python scripts/refactor_identity.py --output=/tmp/identity_new.npz \
      --compare=/tmp/identity_base.npz

With --compare it prints each decode that differs and exits 1 if any does.
"""

import os
import sys

from absl import app
from absl import flags
import jax
import numpy as np

import specdec_jax as sj

OUTPUT = flags.DEFINE_string("output", "/tmp/identity.npz", "Where to write the decodes.")
COMPARE = flags.DEFINE_string("compare", "", "A file written by another checkout to compare to.")
ROWS = flags.DEFINE_integer("rows", 3, "Held-out rows per pair.")
STEPS = flags.DEFINE_integer("steps", 24, "Tokens per decode.")

# name -> (draft builder over the pair, generate options); sampled runs add a key.
SAMPLED = dict(temperature=1.0, topp=0.0)
TOP_P = dict(temperature=0.8, topp=0.9)


def _cases(pair):
  """{name: (draft or None, options)} for one pair."""
  vocab = pair.target.config.vocab_size
  model = pair.drafts.get("small", pair.drafts.get("draft"))
  ngram = pair.ngrams.get("bigram")
  cases = {
      "target_only": (None, {}),
      "model": (model, dict(gamma=4)),
      "model_block": (model, dict(gamma=4, verification="block")),
      "prompt_lookup": (sj.PromptLookupDraft(vocab), dict(gamma=3)),
      "adaptive": (sj.AdaptiveGammaDraft(model), dict(gamma=5)),
      "tree": (sj.TreeDraft(model, (2, 2, 1)), {}),
      "dynamic_tree": (sj.DynamicTreeDraft(model, topk=2, depth=3, node_budget=8), {}),
      "feature": (pair.drafts["feature"], dict(gamma=3)),
      "feature_tree": (sj.TreeDraft(pair.drafts["feature"], (2, 2)), {}),
      "medusa": (pair.drafts["medusa"], dict(gamma=3)),
      "medusa_tree": (sj.TreeDraft(pair.drafts["medusa"], (3, 2, 1)), {}),
  }
  if ngram is not None:
    cases["ngram"] = (ngram, dict(gamma=3))
  return cases


def _decode(pair, draft, options, steps, rows, settings, seed):
  tokens, lengths = pair.inputs(rows)
  out = sj.generate(pair.target, tokens, lengths, max_decode_steps=steps, draft=draft,
                    rng=jax.random.PRNGKey(seed), **settings, **options)
  return np.asarray(out.sequences), np.asarray(out.lengths)


def _save(results, path):
  tmp = path + ".tmp.npz"
  np.savez(tmp, **results)
  os.replace(tmp, path)


def main(_):
  # Resumable: decodes already in the output file are kept, not redone.
  results = dict(np.load(OUTPUT.value)) if os.path.exists(OUTPUT.value) else {}
  for path, label in ((None, "t5"), ("demo_pair_decoder_only", "decoder_only")):
    for dtype in ("float32", "bfloat16"):
      pair = sj.load_demo_pair(path, dtype=dtype)
      for name, (draft, options) in _cases(pair).items():
        if dtype == "bfloat16" and "tree" in name:
          options = dict(options, block_width=16)  # the default 8 holds no 11-slot tree
        runs = [("greedy", {}, 0)]
        if dtype == "float32":
          runs += [("sampled", SAMPLED, 7), ("topp", TOP_P, 11)]
        for run, settings, seed in runs:
          key = f"{label}/{dtype}/{name}/{run}"
          if key + "/sequences" in results:
            continue
          sequences, lengths = _decode(pair, draft, options, STEPS.value, ROWS.value, settings,
                                       seed)
          results[key + "/sequences"] = sequences
          results[key + "/lengths"] = lengths
          print(key, sequences[0, :8].tolist(), flush=True)
        _save(results, OUTPUT.value)
        jax.clear_caches()  # one process compiles ~150 programs: keep its memory flat
  if COMPARE.value:
    base = np.load(COMPARE.value)
    differ = sorted(k for k in results if k not in base or not np.array_equal(base[k], results[k]))
    missing = sorted(set(base.files) - set(results))
    print(f"{len(results) // 2} decodes compared with {COMPARE.value}: {len(differ)} differ, "
          f"{len(missing)} missing")
    for k in differ + missing:
      print("  differs:" if k in differ else "  missing:", k)
    sys.exit(1 if differ or missing else 0)


if __name__ == "__main__":
  app.run(main)
