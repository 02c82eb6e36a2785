"""Gemma and Mistral: sliding windows, sampled speculative decoding (README.md).

  python examples/gemma_mistral.py --target /ckpt/gemma-2-9b --draft /ckpt/gemma-2-2b
"""

import argparse

import jax

import specdec_jax as sj
from specdec_jax import text

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--target", default="/ckpt/gemma-2-9b")
parser.add_argument("--draft", default="/ckpt/gemma-2-2b")
parser.add_argument("--max_decode_steps", type=int, default=64)
args = parser.parse_args()

# bfloat16: 18.5 GB + 5.2 GB of weights (float32, the CPU default, would double it).
target = sj.load_model(args.target, dtype="bfloat16")   # Gemma/Gemma2/Gemma3ForCausalLM,
draft = sj.load_model(args.draft, dtype="bfloat16")     # MistralForCausalLM
tokenizer = text.checkpoint_tokenizer(args.target)      # tokenizer.json or tokenizer.model
rows = text.encode_texts(tokenizer, ["the cat sat on the mat and the dog sat on the log",
                                     "a quick brown fox"])
prompts, prompt_lengths = sj.family_of(target).text_inputs(target.config, rows, 32)  # [2, 32], [2]
spec = sj.generate(target, prompts, prompt_lengths, max_decode_steps=args.max_decode_steps,
                   draft=draft, gamma=4, temperature=1.0, topp=0.95, rng=jax.random.PRNGKey(0))
# Sampled: distributed exactly as the target's. Sliding windows are exact in every
# verification block: a key outside a query's window is masked even when it is in the cache.
for completion in text.decode_rows(tokenizer, spec.sequences, spec.lengths, target.config.eos_id):
  print(repr(completion))
print(spec.stats.summary())
