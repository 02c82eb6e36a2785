r"""Whole-call decode speed through the public API, for comparing checkouts.

Times `specdec_jax.generate` (greedy, batch 1, EOS off) on the demo targets
of both families and on random-weight named shapes of either family:
target-only at block width 1 and at the default width, and speculative with
the demo pair's draft (demo targets only). Only public API is used, so the
same file times an older checkout when that checkout comes first on
PYTHONPATH (a checkout from before issue 13 has no `block_width`: its
target-only decoding is width 1, and it has no other; one from before issue
20 loads the decoder-only pair with `load_decoder_only_demo_pair`):

  git worktree add /tmp/base <commit>
  for i in 1 2 3; do
    PYTHONPATH=/tmp/base JAX_PLATFORMS=cpu python scripts/decode_speed.py \
      --label=base --output_json=/tmp/speed/base_$i.json
    JAX_PLATFORMS=cpu python scripts/decode_speed.py --label=new \
      --output_json=/tmp/speed/new_$i.json
  done
  python scripts/decode_speed.py --summarize=/tmp/speed --reference=base

Alternating processes spreads the machine's drift over both checkouts; the
summary takes, per measurement, the median over runs of each run's fastest
repeat (the least disturbed one on a shared machine).
"""

import glob
import inspect
import json
import os
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import specdec_jax as sj

MODELS = flags.DEFINE_list("models", ["demo_target", "t5_1_1_small", "demo_decoder_only"],
                           "demo_target (the shipped 9.7M T5 target), demo_decoder_only (the "
                           "shipped 2.2M GPT-2-layout target) or config names of either family "
                           "(random weights).")
STEPS = flags.DEFINE_integer("steps", 64, "Tokens per decode.")
REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repeats per measurement.")
GAMMA = flags.DEFINE_integer("gamma", 4, "Draft length for the speculative row.")
DTYPE = flags.DEFINE_string("dtype", "float32", "Weights and compute dtype of every model.")
LABEL = flags.DEFINE_string("label", "", "Name of the checkout being timed.")
OUTPUT = flags.DEFINE_string("output_json", "", "Write this run's results here.")
SUMMARIZE = flags.DEFINE_string("summarize", "", "Summarize the JSON files in this directory "
                                "instead of timing.")
REFERENCE = flags.DEFINE_string("reference", "", "With --summarize: the label to compare to.")


def _timed(fn, repeats: int):
  jax.block_until_ready(fn())  # Compile.
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    samples.append(time.perf_counter() - start)
  return samples


def _cast(model, dtype: str):
  """The model with its config and params in `dtype` (any checkout's public model types)."""
  return type(model)(model.config.replace(dtype=dtype),
                     jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), model.params))


def _write_json_atomic(path: str, record) -> None:
  # Written here, not imported: the module moved between the checkouts compared.
  with open(path + ".tmp", "w") as f:
    json.dump(record, f, indent=1)
  os.replace(path + ".tmp", path)


def _demo(name: str, dtype: str):
  """(target, draft, tokens [1, C], lengths [1] or None) of a shipped demo pair."""
  if name == "demo_target":
    pair = sj.load_demo_pair()
    return (_cast(pair.target, dtype), _cast(pair.drafts["small"], dtype),
            jnp.asarray(pair.heldout_inputs(1)), None)
  if hasattr(sj, "load_decoder_only_demo_pair"):  # Before issue 20.
    pair = sj.load_decoder_only_demo_pair()
    tokens, lengths, draft = pair.prompts[:1], pair.prompt_lengths[:1], pair.draft
  else:
    pair = sj.load_demo_pair("decoder_only")
    (tokens, lengths), draft = pair.inputs(1), pair.drafts["draft"]
  return (_cast(pair.target, dtype), _cast(draft, dtype), jnp.asarray(tokens),
          jnp.asarray(lengths))


def measure(name: str, steps: int, repeats: int, gamma: int, dtype: str = "float32"):
  """{measurement: [seconds per token, per repeat]} for one model."""
  if name.startswith("demo_"):
    target, draft, tokens, lengths = _demo(name, dtype)
  else:
    target, draft, lengths = sj.load_model(name, dtype=dtype, seed=0), None, None
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, target.config.vocab_size,
                                                           (1, 32)), jnp.int32)
    if not hasattr(target.config, "relative_attention_num_buckets"):  # Decoder-only.
      lengths = jnp.asarray([32], jnp.int32)
  spec = dict(draft=draft, gamma=gamma)
  if "block_width" in inspect.signature(sj.generate).parameters:
    runs = {"target_only_w1": dict(block_width=1), "target_only_default_width": dict()}
    if draft is not None:
      runs[f"speculative_gamma{gamma}_width{gamma + 1}"] = dict(spec, block_width=gamma + 1)
      runs[f"speculative_gamma{gamma}_default_width"] = spec
  else:  # Before issue 13: target calls scored 1 token, or gamma + 1 when verifying.
    runs = {"target_only_w1": dict()}
    if draft is not None:
      runs[f"speculative_gamma{gamma}_width{gamma + 1}"] = spec
  out = {}
  for what, kwargs in runs.items():
    call = lambda: sj.generate(target, tokens, lengths, max_decode_steps=steps, eos_id=-1,
                               **kwargs).sequences
    out[what] = [s / steps for s in _timed(call, repeats)]
  return out


def summarize(directory: str, reference: str = "") -> str:
  """Markdown table: ms/token, median over runs of each run's fastest repeat.

  With `reference` (a label), each other checkout also gets its time as a
  fraction of the reference's (below 1: faster).
  """
  by_label = {}
  for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
    with open(path) as f:
      run = json.load(f)
    for model, rows in run["models"].items():
      for what, seconds in rows.items():
        by_label.setdefault(run["label"], {}).setdefault((model, what), []).append(min(seconds))
  if reference and reference not in by_label:
    raise ValueError(f"no runs labelled {reference!r} in {directory}: {sorted(by_label)}")
  labels = sorted(by_label, key=lambda l: (l != reference, l))
  others = [l for l in labels if reference and l != reference]
  lines = ["| model | decode | " + " | ".join(f"{l} ms/token" for l in labels) +
           "".join(f" | {l} / {reference}" for l in others) + " |",
           "|---|---|" + "---|" * (len(labels) + len(others))]
  for key in sorted({key for rows in by_label.values() for key in rows}):
    ms = {l: statistics.median(by_label[l][key]) * 1e3 for l in labels if key in by_label[l]}
    cells = [f"{ms[l]:.3f}" if l in ms else "-" for l in labels]
    cells += [f"{ms[l] / ms[reference]:.2f}" if l in ms and reference in ms else "-"
              for l in others]
    lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
  runs = {l: len(next(iter(by_label[l].values()))) for l in labels}
  return "\n".join(lines) + f"\n\nruns per checkout: {runs}"


def main(argv):
  del argv
  if SUMMARIZE.value:
    print(summarize(SUMMARIZE.value, REFERENCE.value))
    return
  models = {name: measure(name, STEPS.value, REPEATS.value, GAMMA.value, DTYPE.value)
            for name in MODELS.value}
  result = dict(label=LABEL.value or "unnamed", specdec_jax=os.path.dirname(sj.__file__),
                steps=STEPS.value, batch=1, dtype=DTYPE.value, load_average=os.getloadavg(),
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), models=models)
  for name, rows in models.items():
    for what, seconds in rows.items():
      print(f"{result['label']} {name} {what}: {min(seconds) * 1e3:.3f} ms/token (fastest), "
            f"{statistics.median(seconds) * 1e3:.3f} (median)")
  if OUTPUT.value:
    _write_json_atomic(OUTPUT.value, result)


if __name__ == "__main__":
  app.run(main)
