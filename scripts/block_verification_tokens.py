"""Tokens per iteration, token-wise vs block verification, on the shipped demo pairs.

  PYTHONPATH=. python scripts/block_verification_tokens.py [--rows 32] [--seeds 3] [--gamma 4]
      [--families t5,decoder_only] [--drafts small,bigram]

At temperature 1, each (pair, draft, seed) decodes the same held-out rows with
both rules from the same key; prints the mean tokens per iteration (emitted /
target calls, summed over rows) per rule. Block verification's expectation is
never below token-wise verification's (Sun et al. 2025); with a prompt-lookup
(point-mass) draft the two rules have the same law, so equal means are
expected there.
"""

import argparse
import time

import jax
import numpy as np

import specdec_jax as sj


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rows", type=int, default=32)
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--gamma", type=int, default=4)
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--families", default="t5,decoder_only")
  parser.add_argument("--drafts", default=None, help="comma-separated draft names (default all)")
  args = parser.parse_args()
  print(f"rows {args.rows}, seeds {args.seeds}, gamma {args.gamma}, "
        f"temperature {args.temperature}, backend {jax.default_backend()}")
  for family in args.families.split(","):
    pair = sj.load_demo_pair(family)
    tokens, lengths = pair.inputs(args.rows)
    # Models and the pair's feature head (a Draft already): as_draft wraps only models.
    drafts = {name: sj.drafts.as_draft(model) for name, model in pair.drafts.items()}
    if "bigram" in pair.ngrams:
      drafts["bigram"] = pair.ngrams["bigram"]
    drafts["prompt_lookup"] = sj.PromptLookupDraft(pair.target.config.vocab_size)
    for name, draft in drafts.items():
      if args.drafts and name not in args.drafts.split(","):
        continue
      per_rule = {}
      for rule in ("token", "block"):
        emitted = iterations = 0
        seeds = []
        start = time.perf_counter()
        for seed in range(args.seeds):
          out = sj.generate(pair.target, tokens, lengths, max_decode_steps=pair.max_decode_steps,
                            temperature=args.temperature, rng=jax.random.PRNGKey(seed),
                            draft=draft, gamma=args.gamma, verification=rule)
          s = out.stats
          emitted += int(s.emitted.sum())
          iterations += int(s.iterations.sum())
          seeds.append(s.mean_tokens_per_iteration)
        per_rule[rule] = emitted / iterations
        print(f"  {family:12s} {name:14s} {rule:5s}: {emitted / iterations:.4f} tokens/iteration "
              f"({emitted} tokens, {iterations} iterations; per seed "
              f"{', '.join(f'{v:.3f}' for v in seeds)}; {time.perf_counter() - start:.0f} s)",
              flush=True)
      gain = per_rule["block"] / per_rule["token"] - 1
      print(f"  {family:12s} {name:14s} block / token - 1 = {100 * gain:+.2f}%", flush=True)


if __name__ == "__main__":
  main()
