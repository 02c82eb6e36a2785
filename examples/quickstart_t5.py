"""Quickstart, T5: text in, a draft, the target's own greedy output out (README.md).

  python examples/quickstart_t5.py --target /ckpt/flan-t5-xxl --draft /ckpt/flan-t5-small
"""

import argparse

import specdec_jax as sj
from specdec_jax import text

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--target", default="/ckpt/flan-t5-xxl")
parser.add_argument("--draft", default="/ckpt/flan-t5-small")
parser.add_argument("--max_decode_steps", type=int, default=64)
args = parser.parse_args()

target = sj.load_model(args.target)   # HF directory, T5X or Orbax checkpoint
draft = sj.load_model(args.draft)
tokenizer = text.checkpoint_tokenizer(args.target)   # its tokenizer.json or spiece.model (a T5X
                                                     # checkpoint has none: pass the file too)
rows = text.encode_texts(tokenizer, ["translate English to German: The house is wonderful.",
                                     "summarize: the cat sat on the mat and the dog sat on a log"])
# encoder_tokens: int32 [2, 32], each row's ids then EOS, 0-padded on the right.
encoder_tokens, _ = sj.family_of(target).text_inputs(target.config, rows, 32)
out = sj.generate(target, encoder_tokens, max_decode_steps=args.max_decode_steps)  # target only
spec = sj.generate(target, encoder_tokens, max_decode_steps=args.max_decode_steps,
                   draft=draft, gamma=7)
assert (spec.sequences == out.sequences).all()   # greedy: identical
for completion in text.decode_rows(tokenizer, spec.sequences, spec.lengths, target.config.eos_id):
  print(repr(completion))
print(spec.stats.summary())   # α, acceptance rate, tokens/iteration, per-position acceptance
