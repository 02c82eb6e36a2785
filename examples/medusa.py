"""Medusa heads: the decoder-only demo pair's trained heads, through the public Medusa-1
format, in chains and trees (README.md).

  python examples/medusa.py
"""

import argparse
import tempfile

import specdec_jax as sj

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--max_decode_steps", type=int, default=40)
args = parser.parse_args()

pair = sj.load_demo_pair("decoder_only")   # a GPT-2-layout target with trained heads
target = pair.target
untrained = sj.MedusaDraft(target, num_heads=4, num_layers=1)   # share_lm_head=True: the target's
with tempfile.TemporaryDirectory() as directory:   # the public Medusa-1 format, as
  sj.save_medusa_draft(pair.drafts["medusa"], directory)   # medusa-vicuna-7b-v1.3 ships it
  medusa = sj.load_medusa_draft(directory, target)         # (shapes checked against the target)
prompts, lengths = pair.inputs(2)          # [2, pair.input_len] held-out prompts, [2]
tree = sj.TreeDraft(medusa, branching=(4, 2, 1))   # depth d's children from head d
W = tree.num_nodes                         # 21 = 1 + 4 + 8 + 8; the chains use it too
kw = dict(max_decode_steps=args.max_decode_steps, block_width=W)
ref = sj.generate(target, prompts, lengths, **kw)
spec = sj.generate(target, prompts, lengths, draft=medusa, gamma=4, **kw)
grown = sj.generate(target, prompts, lengths, draft=tree, **kw)
random_spec = sj.generate(target, prompts, lengths, draft=untrained, gamma=4, **kw)
for out in (spec, grown, random_spec):     # greedy: the target's own tokens
  assert (out.sequences == ref.sequences).all()
print(repr(pair.tokenizer.decode(prompts[0, :lengths[0]])[-60:]), "->",   # the prompt's end
      repr(pair.tokenizer.decode(ref.sequences[0, :ref.lengths[0]])))
print("trained heads:", spec.stats.summary())
print("their tree:", grown.stats.summary())
print("untrained heads: alpha", random_spec.stats.alpha)
