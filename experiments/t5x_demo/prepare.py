"""Writes the demo pair's target and small draft as T5X checkpoints.

  python -m experiments.t5x_demo.prepare --output_dir=/tmp/t5x_demo

writes /tmp/t5x_demo/target/checkpoint_0 and /tmp/t5x_demo/small/checkpoint_0
(`specdec_jax.export_t5x`), which `python -m t5x.infer` with
configs/t5x/demo_pair_infer.gin restores (see README, "T5X drop-in").
"""

import os

from absl import app
from absl import flags

from specdec_jax.families.t5 import checkpoints
from specdec_jax.demo_pair import load_demo_pair

_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where to write target/ and small/.",
                                  required=True)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace existing checkpoints.")


def prepare(output_dir: str, overwrite: bool = False):
  """Returns {'target': checkpoint dir, 'small': checkpoint dir}."""
  pair = load_demo_pair()
  models = {"target": pair.target, "small": pair.drafts["small"]}
  return {name: checkpoints.export_t5x(model, os.path.join(output_dir, name, "checkpoint_0"),
                                       overwrite=overwrite)
          for name, model in models.items()}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  for name, path in prepare(_OUTPUT_DIR.value, _OVERWRITE.value).items():
    print(f"{name}: {path}")


if __name__ == "__main__":
  app.run(main)
