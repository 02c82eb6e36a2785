"""Feature drafts (EAGLE-style heads): the T5 demo pair's trained head, chain and tree.

  python examples/feature_drafts.py
"""

import argparse

import specdec_jax as sj

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--max_decode_steps", type=int, default=40)
args = parser.parse_args()

pair = sj.load_demo_pair()                 # the trained T5 pair shipped in demo_pair/
head = pair.drafts["feature"]              # its head: a T5 decoder layer on the target's features
x, _ = pair.inputs(2)                      # encoder tokens [2, pair.input_len]: held-out code
tree = sj.DynamicTreeDraft(head, topk=4, depth=4, node_budget=16)   # EAGLE-2 trees
W = tree.num_nodes                         # 16; the chains and the reference use it too
kw = dict(max_decode_steps=args.max_decode_steps, block_width=W)
ref = sj.generate(pair.target, x, **kw)
spec = sj.generate(pair.target, x, draft=head, gamma=4, **kw)
grown = sj.generate(pair.target, x, draft=tree, **kw)
for out in (spec, grown):                  # greedy: the target's own tokens
  assert (out.sequences == ref.sequences).all()
print(repr(pair.heldout[0]["input"][-60:]), "->",   # the input's end, the completion
      repr(pair.tokenizer.decode(ref.sequences[0, :ref.lengths[0]])))
print("trained head:", spec.stats.summary())
print("its dynamic tree:", grown.stats.summary())
