r"""What a verification block costs act 2's targets, per kernel layout (issue 30).

For each demo pair embedded at its act-2 shape (`sj.scale_pair`), in float32:
the target step (k = 1) and the cost curve C(k) (one call scoring k tokens /
one token; `profiling.time_block_calls`, which consumes every position's
logits) with its projection kernels stored [in, out] (Flax's layout) and
[out, in] (`families.kernel_layout`). The ideal is the weight read plus k rows
of arithmetic: C(k) = 1 + (k - 1) * (2 * params / flops per second) / step.

  PYTHONPATH=. python scripts/kernel_layout_cost.py --ks=1,2,5,9,13 \
    --output=benchmarks/issue30/kernel_layout_cost.json
"""

import os
import platform
import sys
import time

from absl import app, flags
import jax

import specdec_jax as sj
from experiments.demo_act2 import DEFAULT_SHAPES
from specdec_jax.results import write_json_atomic
from specdec_jax.tools import profiling

OUTPUT = flags.DEFINE_string("output", None, "Where the JSON goes (atomically).")
KS = flags.DEFINE_list("ks", ["1", "2", "3", "5", "9", "13"], "Block sizes.")
REPEATS = flags.DEFINE_integer("repeats", 5, "Samples per k (median).")


def main(argv):
  del argv
  ks = [int(k) for k in KS.value]
  record = dict(command=" ".join(sys.argv), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                load_average=os.getloadavg(), jax=jax.__version__, rows=[])
  for family, shape in DEFAULT_SHAPES.items():
    pair = sj.load_demo_pair(family)
    scaled = sj.scale_pair(pair, shape)
    inputs, lengths = pair.inputs(1)
    for layout in ("in_out", "out_in"):
      target = sj.with_kernel_layout(scaled.target, layout)
      ms = profiling.time_block_calls({"t": target}, inputs, pair.max_decode_steps, ks,
                                      REPEATS.value, calls=2, lengths=lengths)["t"]
      row = dict(family=family, shape=shape, layout=layout, params=target.config.num_params,
                 step_ms=ms[1], curve={k: ms[k] / ms[1] for k in ks})
      record["rows"].append(row)
      print(f"{family} {shape} {layout}: step {ms[1]:.1f} ms, " + ", ".join(
          f"C({k}) {v:.2f}" for k, v in row["curve"].items() if k > 1), flush=True)
      del target
  record["load_average_end"] = os.getloadavg()
  if OUTPUT.value:
    write_json_atomic(OUTPUT.value, record)


if __name__ == "__main__":
  app.run(main)
