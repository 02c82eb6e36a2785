"""`make demo`: speculative decoding end to end, offline, in well under a minute.

Uses the trained demo pair when its weights (`demo_pair/`) and config
(`configs/demo_pair/demo.gin`, which sets the checkpoints, tokenizer and
inputs) exist; otherwise the tiny random pair of `configs/pairs/tiny_demo.gin`,
whose draft is a noisy copy of the target: it shows exactness and the
acceptance statistics, not a speedup (the draft costs as much as the target).
"""

import os
import tempfile

from absl import app
from absl import logging

from experiments import run as run_lib

DEMO_INPUTS = os.path.join(run_lib.REPO_ROOT, "experiments", "demo_inputs.jsonl")
TRAINED_PAIR_WEIGHTS = os.path.join(run_lib.REPO_ROOT, "demo_pair")
TRAINED_PAIR_GIN = os.path.join(run_lib.REPO_ROOT, "configs", "demo_pair", "demo.gin")


def demo_config():
  """(gin files, bindings, description) of the pair to demonstrate."""
  if os.path.isdir(TRAINED_PAIR_WEIGHTS) and os.path.isfile(TRAINED_PAIR_GIN):
    return [TRAINED_PAIR_GIN], [], "trained demo pair (demo_pair/)"
  return ([os.path.join(run_lib.REPO_ROOT, "configs", "pairs", "tiny_demo.gin"),
           os.path.join(run_lib.REPO_ROOT, "configs", "tasks", "local_file.gin")],
          [f"INPUT_FILE = {DEMO_INPUTS!r}", "MAX_DECODE_STEPS = 24", "BATCH_SIZE = 2",
           "Experiment.timing_repeats = 5"],
          "tiny RANDOM pair (no trained demo_pair/ found): outputs are gibberish bytes, and "
          "the draft is as large as the target, so expect no speedup; this shows exactness")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  gin_files, bindings, description = demo_config()
  run_lib.parse_gin(gin_files, bindings)
  with tempfile.TemporaryDirectory() as output_dir:
    result = run_lib.run_experiment(run_lib.Experiment(), output_dir)
  print(f"\nPair: {description}")
  for sample in result["samples"]:
    print(f"\n  input:       {sample['input']!r}")
    print(f"  baseline:    {sample['baseline']!r}")
    print(f"  speculative: {sample['speculative']!r}")
  print(f"\ngamma {result['gamma']}, temperature {result['temperature']:g}")
  print(f"alpha (Corollary 3.6 estimate): {result['alpha']:.3f}; "
        f"acceptance rate {result['acceptance_rate']:.3f}; "
        f"mean tokens per iteration {result['mean_tokens_per_iteration']:.2f}")
  c = result["c"]
  print(f"c (draft step / target step): {'n/a' if c is None else format(c, '.2f')}; "
        f"predicted speedup {result['predicted_speedup']:.2f}x")
  print(f"walltime: baseline {result['walltime_baseline_s']:.3f}s, speculative "
        f"{result['walltime_speculative_s']:.3f}s, speedup {result['speedup']:.2f}x")
  identical = result["identical_outputs"]
  print("identical outputs: " + ("n/a (sampling)" if identical is None
                                 else "yes" if identical else "NO"))
  if identical is False:
    raise SystemExit(1)


if __name__ == "__main__":
  app.run(main)
