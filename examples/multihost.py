"""Several hosts: the same program on every host, each passing only its own rows (README.md).

  python examples/multihost.py --target /ckpt/xxl --draft /ckpt/small   # every host; TPU, SLURM
  python examples/multihost.py --coordinator_address=host0:1234 --num_processes=N --process_id=R
"""

import argparse

import numpy as np

import specdec_jax as sj
from specdec_jax import multihost, text

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--target", default="/ckpt/xxl")
parser.add_argument("--draft", default="/ckpt/small")
parser.add_argument("--coordinator_address", default=None, help="host:port of process 0")
parser.add_argument("--num_processes", type=int, default=None)
parser.add_argument("--process_id", type=int, default=None)
parser.add_argument("--mesh_shape", default="1,-1", help="data,model; -1: the remaining devices")
parser.add_argument("--max_decode_steps", type=int, default=64)
args = parser.parse_args()

multihost.initialize_distributed(args.coordinator_address, args.num_processes,
                                 args.process_id)   # first; None: auto-detected (TPU, SLURM)
tp, dp = sj.make_partitioners(args.mesh_shape)      # a mesh over every host's devices
target = sj.load_sharded_model(args.target, tp)     # each host reads only its slices
draft = sj.load_sharded_model(args.draft, dp)       # (the draft: replicated)
tokenizer = text.checkpoint_tokenizer(args.target)
host = multihost.process_row_block(2)               # this host's global rows [2p, 2p + 2)
texts = [f"input {i}: the cat sat on the mat" for i in range(host.start, host.stop)]
my_rows, my_lengths = sj.family_of(target).text_inputs(   # [2, 32]: this host's rows only
    target.config, text.encode_texts(tokenizer, texts), 32)
out = sj.generate(target, my_rows, my_lengths, max_decode_steps=args.max_decode_steps,
                  draft=draft, partitioner=tp, draft_partitioner=dp, process_local=True)
everything = multihost.gather_rows(np.asarray(out.sequences))   # every host's rows, in order
if multihost.is_output_process():                   # process 0 writes
  lengths = multihost.gather_rows(np.asarray(out.lengths))
  print(text.decode_rows(tokenizer, everything, lengths, target.config.eos_id))
  print(out.stats.summary())                        # this host's rows
