"""How often a non-first tree path's logits differ, bit for bit, from the same path as a chain.

  PYTHONPATH=.:tests python scripts/tree_rounding.py

On tests/test_tree_attention.py's setup (a (3, 2, 2) tree of 22 nodes after a
5-token prefix, batch 2, float32, random tiny models): scores the whole tree
in one block, then each root-to-leaf path as a plain chain of the tree's
width (the path first, the other nodes after it, unseen by the path), and
counts the path's non-root query rows whose logits are not bitwise equal.
The first path must be equal on every row (by construction, core/token_tree.py);
the others only to rounding, since their ancestors' keys sit at other cache
indices. This is why greedy tree decoding emits only first-path decisions
(core/tree_decoding.py).
"""

import numpy as np

import test_tree_attention as t


def main():
  for name, attention in [("tiny", "dots"), ("tiny", "in_layout"), ("llama_tiny", None),
                          ("gpt2_tiny", None)]:
    s = t._setup(name, attention)
    tokens = s.tree_tokens()
    tree_logits = np.asarray(s(tokens, s.root, s.cache, t._whole_tree())[0])
    width = tokens.shape[1]
    differ = total = 0
    first_equal = None
    for i, path in enumerate(t._paths()):
      rest = [j for j in range(width) if j not in path]
      chain = np.concatenate([tokens[:, path], tokens[:, rest]], axis=1)
      chain_logits = np.asarray(s(chain, s.root, s.cache)[0])[:, :len(path)]
      equal = np.all(tree_logits[:, path] == chain_logits, axis=-1)
      if i == 0:
        first_equal = bool(equal.all())
      else:
        differ += int((~equal[:, 1:]).sum())
        total += equal[:, 1:].size
    print(f"{name} ({attention or 'default'}): first path bit for bit: {first_equal}; other "
          f"paths' query rows not bitwise equal: {differ} / {total}")


if __name__ == "__main__":
  main()
