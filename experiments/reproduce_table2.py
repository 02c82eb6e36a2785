r"""Runs the twelve rows of the paper's Table 2 and prints them beside the paper's.

Each row is `configs/table2/<task>_<draft>_t<temperature>.gin` (T5 1.1 XXL
target, T5 1.1 small/base/large draft, the paper's gamma) run by
`experiments.run`; its results go to `<output_dir>/<row>/results.json`.
Rows whose results already exist are skipped, so an interrupted run resumes
where it stopped (results are written atomically: a row is either finished or
absent).

Real models (fine-tuned per task, as in the paper; `{task}` is 'ende' or
'cnndm', `{draft}` is 'small', 'base' or 'large'):

  python -m experiments.reproduce_table2 --output_dir=/tmp/table2 \
    --target_checkpoint='/ckpt/t5_1_1_xxl_{task}' \
    --draft_checkpoint='/ckpt/t5_1_1_{draft}_{task}' \
    --vocabulary=/ckpt/spiece.model --num_examples=100

Offline smoke run (tiny random stand-ins, a local input file):

  python -m experiments.reproduce_table2 --output_dir=/tmp/t2 --stand_in \
    --input_file=inputs.jsonl --num_examples=4
"""

import os
import sys
from typing import Dict, List, Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import gin

from experiments import run as run_lib
from experiments.paper_tables import TABLE2, Table2Row
from specdec_jax.compile_cache import enable_compile_cache
from specdec_jax import results as results_lib

# Stand-in drafts: noisy copies of the tiny target, noisier for smaller drafts
# (a larger draft agrees more with the target).
STAND_IN_NOISE = {"small": 0.3, "base": 0.2, "large": 0.1}


def row_gin_file(row: Table2Row) -> str:
  return os.path.join(run_lib.REPO_ROOT, "configs", "table2", f"{row.name}.gin")


def row_bindings(row: Table2Row, *, stand_in: bool = False,
                 input_file: Optional[str] = None,
                 target_checkpoint: Optional[str] = None,
                 draft_checkpoint: Optional[str] = None,
                 vocabulary: Optional[str] = None,
                 extra: Sequence[str] = ()) -> List[str]:
  """Gin bindings that specialise a row's config file."""
  fill = dict(task=row.task, draft=row.draft)
  bindings = []
  if stand_in:
    bindings += [
        "TARGET_CHECKPOINT = None", "DRAFT_CHECKPOINT = None",
        "target/ModelSpec.config = @tiny/T5Config()", "target/ModelSpec.name = 'tiny'",
        f"draft/ModelSpec.perturb_target = {STAND_IN_NOISE[row.draft]}",
        "draft/ModelSpec.config = None",
        "Experiment.tokenizer = @ByteTokenizer()",
        "MAX_INPUT_LENGTH = 64", "MAX_DECODE_STEPS = 32",
    ]
  else:
    if target_checkpoint:
      bindings.append(f"TARGET_CHECKPOINT = {target_checkpoint.format(**fill)!r}")
    if draft_checkpoint:
      bindings.append(f"DRAFT_CHECKPOINT = {draft_checkpoint.format(**fill)!r}")
    if vocabulary:
      bindings.append(f"VOCABULARY = {vocabulary!r}")
  if input_file:
    bindings += ["Task.source = 'local'", f"Task.path = {input_file!r}"]
  return bindings + list(extra)


def run_rows(output_dir: str, rows: Sequence[Table2Row] = TABLE2,
             num_examples: Optional[int] = None, **binding_kwargs) -> Dict[str, dict]:
  """Runs every row without results yet; returns {row name: results} for all rows."""
  results = {}
  for index, row in enumerate(rows, start=1):
    row_dir = os.path.join(output_dir, row.name)
    run_lib.parse_gin([row_gin_file(row)], row_bindings(row, **binding_kwargs))
    try:
      # Skipped only when this very row wrote them (the same settings, inputs and
      # checkpoints' contents); a row since changed is refused, naming what changed.
      existing = run_lib.finished_results(run_lib.Experiment(), row_dir, num_examples)
      if existing is not None:
        logging.info("[%d/%d] %s: results exist, skipped", index, len(rows), row.name)
        results[row.name] = existing
        continue
      logging.info("[%d/%d] %s", index, len(rows), row.name)
      results[row.name] = run_lib.run_experiment(run_lib.Experiment(), row_dir, num_examples)
    finally:
      gin.clear_config()
  return results


def comparison_table(results: Dict[str, dict], rows: Sequence[Table2Row] = TABLE2) -> str:
  """Markdown: our alpha / speed / predicted / c beside the paper's, per row."""
  lines = ["| task | draft | temp | γ | α ours / paper | speed ours / paper | "
           "predicted ours / paper | c ours / paper |",
           "|---|---|---|---|---|---|---|---|"]

  def fmt(value, spec):
    return "–" if value is None else format(value, spec)

  for row in rows:
    r = results.get(row.name, {})
    lines.append(
        f"| {row.task} | {row.draft} | {row.temperature:g} | {row.gamma} | "
        f"{fmt(r.get('alpha'), '.2f')} / {row.alpha:.2f} | "
        f"{fmt(r.get('speedup'), '.1f')}X / {row.speedup:.1f}X | "
        f"{fmt(r.get('predicted_speedup'), '.1f')} / {row.predicted:.1f} | "
        f"{fmt(r.get('c'), '.2f')} / {row.c:.2f} |")
  return "\n".join(lines) + "\n"


# --output_dir (one subdirectory per row), --num_examples (per row) and
# --gin_bindings (applied to every row) are experiments.run's flags.
_STAND_IN = flags.DEFINE_bool("stand_in", False,
                              "Tiny random stand-ins instead of T5 1.1 checkpoints (offline).")
_INPUT_FILE = flags.DEFINE_string("input_file", None,
                                  "A local JSONL/TSV file instead of the datasets.")
_TARGET_CHECKPOINT = flags.DEFINE_string(
    "target_checkpoint", None, "Target checkpoint path; may contain {task}.")
_DRAFT_CHECKPOINT = flags.DEFINE_string(
    "draft_checkpoint", None, "Draft checkpoint path; may contain {task} and {draft}.")
_VOCABULARY = flags.DEFINE_string("vocabulary", None, "T5 SentencePiece model file.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not run_lib.OUTPUT_DIR.value:
    raise app.UsageError("--output_dir is required")
  enable_compile_cache()
  try:
    results = run_rows(
        run_lib.OUTPUT_DIR.value, num_examples=run_lib.NUM_EXAMPLES.value, stand_in=_STAND_IN.value,
        input_file=_INPUT_FILE.value, target_checkpoint=_TARGET_CHECKPOINT.value,
        draft_checkpoint=_DRAFT_CHECKPOINT.value, vocabulary=_VOCABULARY.value,
        extra=run_lib.GIN_BINDINGS.value)
  except (ValueError, FileNotFoundError, ImportError, RuntimeError, TypeError) as e:
    logging.error("%s", e)
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  table = comparison_table(results)
  if _STAND_IN.value:
    table = ("Stand-in models (tiny random target, noisy-copy drafts): the numbers test the "
             "pipeline, not the paper.\n\n" + table)
  results_lib.write_text_atomic(os.path.join(run_lib.OUTPUT_DIR.value, "table2.md"), table)
  print(table)


if __name__ == "__main__":
  app.run(main)
