"""Converts a Hugging Face T5 directory or a T5X checkpoint to our Orbax format (or to T5X's).

  python scripts/convert_checkpoint.py --input=/path/to/flan-t5-small \
      --output=/path/to/flan_t5_small_orbax --dtype=bfloat16
  python scripts/convert_checkpoint.py \
      --input=gs://t5-data/pretrained_models/t5x/t5_1_1_xxl/checkpoint_1000000 \
      --output=/data/t5_1_1_xxl --dtype=bfloat16

  python scripts/convert_checkpoint.py --input=/path/to/flan-t5-small \
      --output=/ckpt/flan_t5_small/checkpoint_0 --format=t5x

The output loads with `specdec_jax.load_model(output)`; with --format=t5x it is
a T5X checkpoint directory that T5X's `Checkpointer.restore` (and so
`t5x.infer` / `t5x.eval` via RestoreCheckpointConfig) reads. Tensors are read and
cast one at a time (tqdm bar), so host memory peaks near one copy of the params
in `--dtype`.
"""

from absl import app
from absl import flags

from specdec_jax.families.t5 import checkpoints

_INPUT = flags.DEFINE_string("input", None, "HF directory / hub id, T5X checkpoint_N directory "
                             "or TensorStore URL, or an Orbax checkpoint.", required=True)
_OUTPUT = flags.DEFINE_string("output", None, "Output directory (must not exist unless "
                              "--overwrite).", required=True)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"],
                           "dtype the params are stored in.")
_FORMAT = flags.DEFINE_enum("format", "orbax", ["orbax", "t5x"],
                            "orbax: save_model (specdec_jax's own); t5x: export_t5x.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --output.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  model = checkpoints.load_checkpoint_model(_INPUT.value, dtype=_DTYPE.value, progress=True)
  if _FORMAT.value == "t5x":
    checkpoints.export_t5x(model, _OUTPUT.value, overwrite=_OVERWRITE.value)
  else:
    checkpoints.save_model(model, _OUTPUT.value, overwrite=_OVERWRITE.value)
  config = model.config
  print(f"wrote {_OUTPUT.value}: {config.num_params / 1e6:.1f}M params, {config.dtype}, "
        f"{config.num_encoder_layers}/{config.num_decoder_layers} layers, emb {config.emb_dim}")


if __name__ == "__main__":
  app.run(main)
