"""Token trees (static and EAGLE-2-style dynamic) and block verification, greedy (README.md).

  python examples/trees_and_block.py --target /ckpt/Llama-3.1-8B --draft /ckpt/Llama-3.2-1B
"""

import argparse

import specdec_jax as sj
from specdec_jax import text

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--target", default="/ckpt/Llama-3.1-8B")
parser.add_argument("--draft", default="/ckpt/Llama-3.2-1B")
parser.add_argument("--max_decode_steps", type=int, default=64)
args = parser.parse_args()

target, draft = sj.load_model(args.target), sj.load_model(args.draft)
tokenizer = text.checkpoint_tokenizer(args.target)
rows = text.encode_texts(tokenizer, ["def fibonacci(n):", "the cat sat on the mat"])
prompts, lengths = sj.family_of(target).text_inputs(target.config, rows, 32)  # [2, 32], [2]
steps = args.max_decode_steps

tree = sj.TreeDraft(draft, (2, 2, 1))       # 2 first tokens, 2 continuations each, then 1
# children="without_replacement" (default) | "iid" | "topk"; the draft may be an NgramDraft.
dynamic = sj.DynamicTreeDraft(draft, topk=4, depth=4, node_budget=16)   # EAGLE-2 style
# (a budget above the topk + (depth - 1) topk^2 candidates it grows is cut to hold them all)
W = max(tree.num_nodes, dynamic.num_nodes)   # 11 = 1 + 2 + 4 + 4, and 16: one block holds either
ref = sj.generate(target, prompts, lengths, max_decode_steps=steps, block_width=W)
spec = sj.generate(target, prompts, lengths, max_decode_steps=steps, draft=tree, block_width=W)
grown = sj.generate(target, prompts, lengths, max_decode_steps=steps, draft=dynamic,
                    block_width=W)
block = sj.generate(target, prompts, lengths, max_decode_steps=steps, draft=draft, gamma=4,
                    verification="block", block_width=W)
for out in (spec, grown, block):   # greedy: the target's own tokens at the same W
  assert (out.sequences == ref.sequences).all()
print(text.decode_rows(tokenizer, ref.sequences, ref.lengths, target.config.eos_id))
print("tree:", spec.stats.summary())   # adds depth_histogram, per_rank_acceptance
print("dynamic tree:", grown.stats.summary())
print("block verification:", block.stats.summary())
rates = spec.stats.per_rank_acceptance   # a rank's acceptance after lower ranks failed
print("best static tree in", W, "nodes:", sj.theory.best_tree_shape(rates, node_budget=W,
                                                                   max_depth=4))
