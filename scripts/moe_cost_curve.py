r"""What verifying k tokens costs a mixture-of-experts target (issue 34): C(k) for k = 1..16.

A dense target scoring k tokens reads its weights once; a MoE target routes the k tokens
to up to k * top_k distinct experts per layer, so its C(k) (one call on k tokens / one
call on 1) grows faster than a dense model's of the same active size, and the best gamma
shrinks (REFERENCE.md section 9). This script measures C(k) at each batch size for:

  moe        a MoE layout (--layout: mixtral, or deepseek_v3 where the family has it),
             random weights at a memory-bound size on this CPU
  dense      a dense (Llama-layout) target of the same ACTIVE parameters per token:
             the same attention, an MLP of top_k (+ shared) experts' width

and gives, for each, the gamma that Theorem 3.8 with the measured C(k) predicts best at
the acceptance rates --alphas and draft cost --c (`tools.speedup.choose_gamma`).

  python scripts/moe_cost_curve.py --layouts=mixtral --batch_sizes=1,4 \
      --output_json=benchmarks/cpu/issue34/moe_cost_curve.json
"""

import json
import os
import time
from typing import Any, Dict

from absl import app, flags
import jax
import numpy as np

import specdec_jax as sj
from specdec_jax.families.decoder_only.config import get_decoder_config
from specdec_jax.results import write_json_atomic
from specdec_jax.tools import profiling
from specdec_jax.tools.speedup import choose_gamma

LAYOUTS = flags.DEFINE_list("layouts", ["mixtral", "deepseek_v3"], "MoE layouts: mixtral, "
                            "deepseek_v3.")
BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "4"], "Batch sizes.")
MAX_K = flags.DEFINE_integer("max_k", 16, "C(k) for k = 1..max_k.")
ALPHAS = flags.DEFINE_list("alphas", ["0.6", "0.8"], "Acceptance rates for the best gamma.")
C = flags.DEFINE_float("c", 0.05, "Draft cost per token / target step, for the best gamma.")
REPEATS = flags.DEFINE_integer("repeats", 5, "Timed samples per k (median).")
SMALL = flags.DEFINE_bool("small", False, "Tiny shapes (tests): numbers meaningless.")
OUTPUT_JSON = flags.DEFINE_string("output_json", "", "Write the results here (atomically).")

# Memory-bound on this 2-core CPU (~1-2 GB of float32 weights), few layers.
SHAPES = {
    "mixtral": dict(emb_dim=1024, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
                    mlp_dim=3584, num_experts=8, num_experts_per_tok=2, vocab_size=8192,
                    sliding_window=None, max_positions=512),
    # One dense layer then one MoE layer (first_k_dense_replace 1), 16 routed experts top 4
    # in 4 groups (top 2 groups), one shared expert, latent attention.
    "deepseek_v3": dict(emb_dim=1024, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=96,
                        mlp_dim=4096, num_experts=16, num_experts_per_tok=4, moe_mlp_dim=1536,
                        n_shared_experts=1, n_group=4, topk_group=2, q_lora_rank=384,
                        kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
                        v_head_dim=64, vocab_size=8192, max_positions=512,
                        first_k_dense_replace=1, rope_scaling=None),
}


def _configs(layout: str):
  """(the MoE config, the dense config of its active size)."""
  base = get_decoder_config(f"{layout}_tiny")
  shape = dict(SHAPES.get(layout, {}))
  if SMALL.value:
    shape = {}  # the layout's tiny named config as it is
  moe = base.replace(**{k: v for k, v in shape.items() if hasattr(base, k)})
  # Active per token: the routed top-k and the shared experts (MoE layers); attention kept
  # as a Llama layer of the same width (latent attention's own cost is part of C(k)).
  experts = moe.num_experts_per_tok + (getattr(moe, "n_shared_experts", None) or 0)
  expert_width = moe.moe_mlp_dim or moe.mlp_dim
  dense = get_decoder_config("llama_tiny").replace(
      emb_dim=moe.emb_dim, num_layers=moe.num_layers, num_heads=moe.num_heads,
      num_kv_heads=moe.num_kv_heads, head_dim=128 if not SMALL.value else moe.head_dim,
      mlp_dim=experts * expert_width, vocab_size=moe.vocab_size,
      max_positions=moe.max_positions)
  return moe, dense


def main(argv):
  del argv
  ks = list(range(1, MAX_K.value + 1))
  document: Dict[str, Any] = dict(
      machine=dict(backend=jax.default_backend(), cpu_count=os.cpu_count(),
                   date=time.strftime("%Y-%m-%d %H:%M")),
      ks=ks, alphas=[float(a) for a in ALPHAS.value], c=C.value, results=[])
  for layout in LAYOUTS.value:
    moe_config, dense_config = _configs(layout)
    for name, config in (("moe", moe_config), ("dense", dense_config)):
      model = sj.load_model(config, seed=0, dtype="float32")
      for b in [int(v) for v in BATCH_SIZES.value]:
        inputs = np.full((b, 8), 5, np.int32)
        ms = profiling.time_block_calls({"m": model}, inputs, 2 * MAX_K.value + 4, ks,
                                        REPEATS.value, calls=4,
                                        lengths=np.full((b,), 8, np.int32))["m"]
        curve = {k: ms[k] / ms[1] for k in ks}
        best = {str(a): choose_gamma(float(a), C.value, curve, MAX_K.value - 1)
                for a in ALPHAS.value}
        row = dict(layout=layout, target=name, config=str(config), params=config.num_params,
                   batch_size=b, step_ms=ms[1], curve={str(k): v for k, v in curve.items()},
                   best_gamma=best)
        document["results"].append(row)
        print(f"{layout} {name} B={b}: step {ms[1]:.2f} ms; C(k) " +
              " ".join(f"{k}:{curve[k]:.2f}" for k in ks) + f"; best gamma {best}", flush=True)
        if OUTPUT_JSON.value:
          os.makedirs(os.path.dirname(OUTPUT_JSON.value) or ".", exist_ok=True)
          write_json_atomic(OUTPUT_JSON.value, document)
      del model
  print(json.dumps({"rows": len(document["results"])}))


if __name__ == "__main__":
  app.run(main)
