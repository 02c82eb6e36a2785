r"""The standard evaluation: every method x every category of a benchmark, in one command.

    python -m experiments.evaluate --pair=demo_decoder_only --benchmark=demo \
        --methods=model,prompt_lookup,eagle --output_dir=/tmp/eval

Spec-Bench's protocol by default (REFERENCE.md section 12): greedy, batch 1,
max_new_tokens 1024 (a demo pair: what it was trained to write), the mean of 3
runs, speedup = the mean per-input tokens/s over vanilla's. Methods are
interleaved input by input, compile time is excluded and reported, and every
greedy output must equal target-only decoding's: the run names any that
differs and exits 1 (sampled runs: the per-category sign tests of
`specdec_jax.evaluation.law`). Outputs: results.json (its layout in
`specdec_jax.evaluation.report`), results.md (the paper-style table) and
speedup_tau.png, written atomically; an interrupted run resumes per
(method, input).

The target and drafts come from `--pair` (demo_t5, demo_decoder_only) or,
without it, from gin files and bindings as the launcher's (`experiments.run`):
the target `Experiment.target`, 'model' its `Experiment.draft`, and drafts of
any name from `evaluation_drafts.drafts` (configs/evaluate/*.gin).

--benchmark: 'demo' (the pair's shipped mini-benchmark), 'table2' (the paper's
EnDe and CNN/DM tasks of configs/evaluate/table2.gin), a dataset name or a path
(`specdec_jax.evaluation.benchmarks`: Spec-Bench, MT-Bench, SPEED-Bench, plain
jsonl/tsv).
"""

import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from absl import app
from absl import flags
from absl import logging
import gin

from experiments.gin_flags import GIN_BINDINGS, GIN_FILES, GIN_SEARCH_PATHS, rewrite_gin_args
from experiments.output_lock import OutputLock
from experiments import evaluate_setup as setup_lib
# Shared with the launcher: --pair (here also demo_t5 / demo_decoder_only), --output_dir,
# --wait_for_output_dir.
from experiments.run import OUTPUT_DIR, PAIR, WAIT_FOR_OUTPUT_DIR
from specdec_jax.compile_cache import enable_compile_cache
from specdec_jax.evaluation import costs as costs_lib
from specdec_jax.evaluation import report, runner
from specdec_jax.evaluation.store import RecordStore

BENCHMARK = flags.DEFINE_string("benchmark", "demo", "demo (the pair's mini-benchmark), "
                                "table2, a dataset name (spec_bench, mt_bench, "
                                "speed_bench_qualitative, speed_bench_throughput) or a path.")
METHODS = flags.DEFINE_list("methods", ["all"], "Methods to compare ('all': every one the "
                            "pair ships); vanilla (target-only) is always one of them.")
CATEGORIES = flags.DEFINE_list("categories", None, "Only these categories (default: all).")
LIMIT = flags.DEFINE_integer("limit_per_category", None, "At most N questions a category.")
MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", None, "Tokens per turn at most "
                                      "(default 1024, Spec-Bench's; a demo pair: its own).")
# --runs, --sampling_seed: not --repeats / --seed, which scripts/benchmark.py and
# experiments/mini_table2.py define with other meanings (tests import them together).
REPEATS = flags.DEFINE_integer("runs", 3, "Timed decodes of every input per method, "
                               "interleaved (Spec-Bench: the mean of 3 runs).")
TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy (Spec-Bench); > 0 samples.")
TOPK = flags.DEFINE_integer("topk", 0, "Sampling: keep the k likeliest tokens (0: all).")
TOPP = flags.DEFINE_float("topp", None, "Sampling: nucleus mass in (0, 1].")
GAMMA = flags.DEFINE_integer("gamma", 4, "Tokens drafted per iteration (chains).")
BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", None, "Inputs decoded together: 1 (Spec-Bench's; the default), or a "
    "category's inputs through that many generate_many slots (default for SPEED-Bench's "
    "throughput split: its concurrency).")
SEED = flags.DEFINE_integer("sampling_seed", 0, "Root of the sampling keys.")
MAX_INPUT_LENGTH = flags.DEFINE_integer("max_input_length", 2048, "The widest prompt.")
WIDTH_FACTOR = flags.DEFINE_integer(
    "width_factor", 2, "Prompts are padded to 32 x width_factor^k tokens: each method "
    "compiles one program per width (4: fewer programs, more padding).")
CHAT_TEMPLATE = flags.DEFINE_enum(
    "chat_template", "auto", ["auto", "plain"],
    "auto: turns through the target tokenizer's chat template (required for multi-turn "
    "inputs); plain: turns and answers joined as text.")
COSTS = flags.DEFINE_bool("costs", True, "Also time each draft's c and the verification "
                          "cost C(W), and give the theory's speedup from the measured τ.")
PLOT = flags.DEFINE_bool("plot", True, "Write speedup_tau.png (needs matplotlib).")
SCALE_TO = flags.DEFINE_string(
    "scale_to", None, "Demo pairs: the trained target embedded function-preservingly at a "
    "large model's shape (T5: t5_1_1_xxl; decoder-only: gpt2_xl, or overrides such as "
    "gpt2_xl:emb_dim=4608,num_heads=72,mlp_dim=18432,num_layers=40), its heads grown with it: "
    "every method at that model's cost with the pair's real acceptance. SHAPE/DRAFT_SHAPE "
    "also embeds the model draft and PARD's model there (T5's default: t5_1_1_small; "
    "'shipped' keeps them). bfloat16 on accelerators. specdec_jax.evaluation.methods."
    "scale_demo_pair.")


def evaluate(prepared: setup_lib.Prepared, output_dir: str, plot: bool = True,
             clock=None, progress=None, costs: bool = True) -> Dict[str, Any]:
  """Runs a prepared evaluation into output_dir and writes its results; returns them.

  costs: also time each draft's one-token step against the target's (c), the
  verification call's C(W), and give the theory's speedup from the measured τ
  (`specdec_jax.evaluation.costs`); a few seconds of compiles per method."""
  decoder = runner.Decoder(prepared.subject, prepared.settings,
                           **({} if clock is None else dict(clock=clock)))
  store = RecordStore(output_dir, prepared.identity)
  resumed = store.count()
  if resumed:
    logging.info("resuming: %d records already in %s", resumed, output_dir)
  records = runner.run_benchmark(decoder, prepared.methods, prepared.benchmark, store,
                                 progress)
  widths = {name: runner.block_width(prepared.subject, m, prepared.settings)
            for name, m in prepared.methods.items()}
  result = report.assemble(prepared.methods, records, prepared.benchmark,
                           prepared.identity["settings"], widths, prepared.settings.greedy)
  if costs:
    _add_costs(prepared, decoder, widths, result)
  result["resumed_records"] = resumed
  result["notes"] = list(prepared.notes)
  report.write(output_dir, result, plot=plot)
  return result


def _add_costs(prepared: setup_lib.Prepared, decoder: runner.Decoder,
               widths: Dict[str, int], result: Dict[str, Any]) -> None:
  """Each method's c, C(W) and predicted speedup, timed on the first question's prompt."""
  first = prepared.benchmark.questions[0]
  inputs, lengths = decoder.inputs(runner.prompt_ids(prepared.subject, first.turns[:1], []))
  found = costs_lib.method_costs(prepared.subject.target, inputs, lengths,
                                 prepared.settings.max_new_tokens, prepared.methods, widths,
                                 result["methods"])
  for name, values in found.items():
    result["methods"][name].update(values)


def _progress(done: int, total: int) -> None:
  print(f"\r{done}/{total} questions", end="" if done < total else "\n", file=sys.stderr,
        flush=True)


def _summary(result: Dict[str, Any]) -> List[str]:
  """The console's last lines: the table, then whether the outputs were checked equal."""
  lines = [report.markdown(result).split("\n\n")[1]]  # The speedup · τ table.
  equality = result["equality"]
  if equality["passed"]:
    lines.append(f"equality: passed ({equality['checked']})")
  else:
    for name, rows in equality.get("differing", {}).items():
      lines.append(f"equality FAILED: {name} differs from target-only decoding on "
                   f"{len(rows)} input(s): " + ", ".join(
                       f"{r['question_id']} ({r['category']}, turn {r['turn']})"
                       for r in rows[:10]))
    for name, categories in equality.get("failed", {}).items():
      lines.append(f"law check FAILED: {name} in {categories}")
  return lines


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  enable_compile_cache()
  try:
    if OUTPUT_DIR.value is None:
      raise ValueError("--output_dir is required (results and resumable records go there)")
    with OutputLock(OUTPUT_DIR.value, wait=WAIT_FOR_OUTPUT_DIR.value):
      prepared = setup_lib.prepare(setup_lib.Options(
          pair=PAIR.value, benchmark=BENCHMARK.value, methods=METHODS.value,
          categories=CATEGORIES.value, limit_per_category=LIMIT.value,
          max_new_tokens=MAX_NEW_TOKENS.value, repeats=REPEATS.value,
          temperature=TEMPERATURE.value, topk=TOPK.value, topp=TOPP.value, gamma=GAMMA.value,
          batch_size=BATCH_SIZE.value, seed=SEED.value,
          max_input_length=MAX_INPUT_LENGTH.value, width_factor=WIDTH_FACTOR.value,
          chat_template=CHAT_TEMPLATE.value,
          gin_files=GIN_FILES.value, gin_bindings=GIN_BINDINGS.value,
          gin_search_paths=GIN_SEARCH_PATHS.value, scale_to=SCALE_TO.value))
      result = evaluate(prepared, OUTPUT_DIR.value, PLOT.value, progress=_progress,
                        costs=COSTS.value)
  except (ValueError, FileNotFoundError, ImportError, TypeError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)
  except KeyboardInterrupt:
    print("\nstopped: rerun the same command to resume (finished records are kept)",
          file=sys.stderr)
    sys.exit(130)
  for line in _summary(result):
    print(line)
  print(f"written: {', '.join(os.path.join(OUTPUT_DIR.value, n) for n in (report.RESULTS_JSON, report.RESULTS_MD, report.PLOT_PNG))}")
  if not result["equality"]["passed"]:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main, argv=rewrite_gin_args(sys.argv))
