"""Parallel drafters: the decoder-only demo pair's trained DFlash and PARD drafters, each
filling a whole proposal in one call, in chains and trees, greedy and sampled (README.md).

  python examples/parallel_drafters.py
"""

import argparse
import tempfile

import jax

import specdec_jax as sj

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--max_decode_steps", type=int, default=40)
args = parser.parse_args()

pair = sj.load_demo_pair("decoder_only")   # a GPT-2-layout target with trained drafters
target = pair.target
with tempfile.TemporaryDirectory() as directory:   # z-lab's public DFlash format
  sj.save_dflash_draft(pair.drafts["dflash"], directory)
  dflash = sj.load_dflash_draft(directory, target)  # layers over the target's features
pard = pair.drafts["parallel"]             # a small model run once over context + masks
prompts, lengths = pair.inputs(2)          # [2, pair.input_len] held-out prompts, [2]
tree = sj.TreeDraft(dflash, branching=(2, 2, 1))   # depth d's children from position d + 1
W = tree.num_nodes                         # 11 = 1 + 2 + 4 + 4; the chains use it too
kw = dict(max_decode_steps=args.max_decode_steps, block_width=W)
ref = sj.generate(target, prompts, lengths, **kw)
for name, draft, extra in (("dflash", dflash, dict(gamma=4)), ("parallel", pard, dict(gamma=4)),
                           ("dflash tree", tree, {})):
  out = sj.generate(target, prompts, lengths, draft=draft, **extra, **kw)
  assert (out.sequences == ref.sequences).all()   # greedy: the target's own tokens
  print(f"{name}:", out.stats.summary())
sampled = sj.generate(target, prompts, lengths, draft=dflash, gamma=4, temperature=1.0,
                      rng=jax.random.PRNGKey(0), **kw)   # each draft drawn from its own law
print("sampled, temperature 1:", sampled.stats.summary())
print(repr(pair.tokenizer.decode(ref.sequences[0, :ref.lengths[0]])))
