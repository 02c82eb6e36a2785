"""Quickstart, decoder-only (Llama, Qwen2, GPT-2): ragged prompts, a draft model, prompt lookup.

  python examples/quickstart_decoder_only.py --target /ckpt/Llama-3.1-8B --draft /ckpt/Llama-3.2-1B
"""

import argparse

import specdec_jax as sj
from specdec_jax import text

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--target", default="/ckpt/Llama-3.1-8B")
parser.add_argument("--draft", default="/ckpt/Llama-3.2-1B")
parser.add_argument("--max_decode_steps", type=int, default=64)
args = parser.parse_args()

target = sj.load_model(args.target)   # LlamaForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel
draft = sj.load_model(args.draft)     # a smaller model of the same family and vocabulary
tokenizer = text.checkpoint_tokenizer(args.target)   # adds BOS where the model wants one
rows = text.encode_texts(tokenizer, ["def fibonacci(n):", "the cat sat on the mat and the dog"])
# prompts: int32 [2, 32], right-padded; prompt_lengths: int32 [2], each row's own length.
prompts, prompt_lengths = sj.family_of(target).text_inputs(target.config, rows, 32)
steps = args.max_decode_steps
out = sj.generate(target, prompts, prompt_lengths, max_decode_steps=steps)
spec = sj.generate(target, prompts, prompt_lengths, max_decode_steps=steps, draft=draft, gamma=4)
assert (spec.sequences == out.sequences).all()   # the new tokens only; rows of any prompt length
lookup = sj.generate(target, prompts, prompt_lengths, max_decode_steps=steps,
                     draft=sj.PromptLookupDraft(target.config.vocab_size), gamma=4)
assert (lookup.sequences == out.sequences).all()
for completion in text.decode_rows(tokenizer, spec.sequences, spec.lengths, target.config.eos_id):
  print(repr(completion))
print("draft model:", spec.stats.summary())
print("prompt lookup:", lookup.stats.summary())
