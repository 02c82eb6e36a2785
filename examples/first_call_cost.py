"""First-call cost: each new shape compiles once; prompts padded to a few widths share programs.

  python examples/first_call_cost.py --target /ckpt/gemma-3-1b
"""

import argparse
import time

import numpy as np
from absl import logging

import specdec_jax as sj
from specdec_jax import text

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--target", default="/ckpt/gemma-3-1b")
parser.add_argument("--max_decode_steps", type=int, default=64)
args = parser.parse_args()

sj.enable_compile_cache()               # compiled programs persist: a rerun reads them back
logging.set_verbosity(logging.INFO)     # "compiling decode for ...: first call (compile) took N s"
target = sj.load_model(args.target)
tokenizer = text.checkpoint_tokenizer(args.target)
for prompt in ["def f(x):", "the cat sat on the mat", "a quick brown fox jumps over the dog " * 3]:
  ids = text.encode_texts(tokenizer, [prompt])[0]
  width = next(w for w in (16, 64, 256) if w >= len(ids))   # a few fixed prompt widths
  prompts = np.full((1, width), target.config.pad_id, np.int32)
  prompts[0, :len(ids)] = ids
  start = time.perf_counter()
  out = sj.generate(target, prompts, np.array([len(ids)], np.int32),
                    max_decode_steps=args.max_decode_steps, draft=sj.PromptLookupDraft(
                        target.config.vocab_size), gamma=4)
  new_ids = np.asarray(out.sequences[0, :out.lengths[0]])   # waits for the decode
  print(f"{len(ids)} tokens, width {width}: {time.perf_counter() - start:.2f} s",
        repr(tokenizer.decode(new_ids)))
