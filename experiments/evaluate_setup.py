"""What `experiments.evaluate` decodes with, checked before any decode.

`prepare(options)` reads the benchmark, builds the target and the named methods
(a demo pair's, or the launcher's gin configuration's) and checks every input
that can be checked without decoding: unknown methods or categories, fields a
benchmark line lacks, a multi-turn benchmark without a chat template, a draft
whose tokenizer is not the target's, prompts the target cannot hold.
"""

import dataclasses
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from absl import logging
import gin
import jax

from experiments.gin_flags import parse_gin
from specdec_jax import demo_pair as demo_pair_lib
from specdec_jax import text
from specdec_jax.evaluation import benchmarks, conversation, methods as methods_lib
from specdec_jax.evaluation import runner
from specdec_jax.evaluation.methods import Method
from specdec_jax.evaluation.questions import Benchmark
from specdec_jax.families.registry import family_of

PAIRS = {"demo_t5": "t5", "demo_decoder_only": "decoder_only"}
DEMO_BENCHMARK_FILE = "benchmark.jsonl"  # in each demo pair's directory
TABLE2_GIN = "configs/evaluate/table2.gin"
SPEC_BENCH_MAX_NEW_TOKENS = 1024


@dataclasses.dataclass(frozen=True)
class Options:
  """The command line's choices (`experiments.evaluate`'s flags)."""
  pair: Optional[str] = None
  benchmark: str = "demo"
  methods: Sequence[str] = ("all",)
  categories: Optional[Sequence[str]] = None
  limit_per_category: Optional[int] = None
  max_new_tokens: Optional[int] = None
  repeats: int = 3
  temperature: float = 0.0
  topk: int = 0
  topp: Optional[float] = None
  gamma: int = 4
  batch_size: Optional[int] = None
  seed: int = 0
  max_input_length: int = 2048
  width_factor: int = 2
  chat_template: str = "auto"
  gin_files: Sequence[str] = ()
  gin_bindings: Sequence[str] = ()
  gin_search_paths: Sequence[str] = ()
  # A demo pair at a large model's cost: 'SHAPE' or 'SHAPE/DRAFT_SHAPE'
  # (`methods.scale_demo_pair`); None: the pair as shipped.
  scale_to: Optional[str] = None

  def __post_init__(self):
    if self.scale_to is not None and self.pair not in PAIRS:
      raise ValueError(f"--scale_to embeds a demo pair's target: pass --pair="
                       f"{' or '.join(sorted(PAIRS))} (got --pair={self.pair})")


@dataclasses.dataclass(frozen=True)
class Prepared:
  """Everything an evaluation decodes with; identity: what decides its records."""
  subject: runner.Subject
  methods: Dict[str, Method]
  benchmark: Benchmark
  settings: runner.Settings
  identity: Dict[str, Any]
  notes: Tuple[str, ...] = ()


@gin.configurable
def evaluation_drafts(drafts: Optional[Dict[str, Any]] = None,
                      paths: Optional[Dict[str, str]] = None):
  """Gin: named drafts beyond the launcher's one (`drafts`: {name: @ModelSpec() or
  @DraftKind()}; Table 2's small/base/large) and the directories of the head-like
  methods (`paths`: {'eagle' | 'medusa' | 'dflash' | 'pard': directory})."""
  return dict(drafts or {}), dict(paths or {})


def _check_options(options: Options) -> None:
  """The flags' own values, before anything is read."""
  problems = []
  for name, value, low in (("repeats", options.repeats, 1), ("gamma", options.gamma, 1),
                           ("batch_size", options.batch_size or 1, 1),
                           ("max_input_length", options.max_input_length, 2),
                           ("width_factor", options.width_factor, 2),
                           ("max_new_tokens", options.max_new_tokens or 1, 1)):
    if value < low:
      problems.append(f"--{name} must be >= {low}, got {value}")
  if options.pair is None and not options.gin_files:
    problems.append("no target: pass --pair (demo_t5, demo_decoder_only, or a configs/pairs "
                    "name such as local) or --gin_file files that bind the launcher's "
                    "Experiment.target")
  if options.pair is not None and options.pair not in PAIRS:
    from experiments import run as run_lib
    try:
      run_lib.pair_gin_files(options.pair, ())
    except ValueError as e:
      problems.append(f"{e}; or a demo pair: {', '.join(sorted(PAIRS))}")
  if options.temperature < 0:
    problems.append(f"--temperature must be >= 0, got {options.temperature}")
  if problems:
    raise ValueError("; ".join(problems))


def _method_names(requested: Sequence[str], known: Sequence[str]) -> List[str]:
  names = list(known) if list(requested) in (["all"], []) else list(requested)
  return methods_lib.with_vanilla(names)


def _demo(options: Options):
  """(subject, methods, the pair's benchmark path, its max_new_tokens, its directory) of a
  demo pair; with --scale_to, its target embedded at that shape and its drafts fit to it
  (`methods.scale_demo_pair`), said in vanilla's description (results.md's legend)."""
  if options.scale_to:
    pair = demo_pair_lib.load_demo_pair(PAIRS[options.pair], dtype=methods_lib.scaled_dtype())
    pair, scaled = methods_lib.scale_demo_pair(pair, options.scale_to)
  else:
    pair, scaled = demo_pair_lib.load_demo_pair(PAIRS[options.pair]), None
  known = list(methods_lib.demo_builders(pair))
  names = _method_names(options.methods, known)
  built = methods_lib.demo_methods(pair, names, options.gamma)
  if scaled:
    logging.info("--scale_to=%s: %s", options.scale_to, scaled)
    vanilla = built[methods_lib.VANILLA]
    built[methods_lib.VANILLA] = dataclasses.replace(
        vanilla, description=f"{vanilla.description}; {scaled}")
  subject = runner.Subject(pair.target, pair.tokenizer)
  path = os.path.join(demo_pair_lib.DIRS[pair.family], DEMO_BENCHMARK_FILE)
  return subject, built, path, pair.max_decode_steps, demo_pair_lib.DIRS[pair.family]


def _gin_subject(options: Options):
  """(subject, methods) from the launcher's gin configuration."""
  from experiments import run as run_lib  # The launcher's specs and loading.
  exp = run_lib.Experiment(task=None)
  exp.target.validate("target")
  tokenizer = exp.tokenizer or text.checkpoint_tokenizer(exp.target.checkpoint, exp.vocabulary)
  extra, paths = evaluation_drafts()
  specs = {"model": exp.draft, **extra}
  specs.update({"prompt_lookup": run_lib.DraftKind("prompt_lookup"),
                "ngram": run_lib.DraftKind("ngram")})
  specs.update({"sparse_cache": run_lib.DraftKind("sparse_cache"),
                "sparse_retrieval": run_lib.DraftKind("sparse_cache", policy="retrieval")})
  for name, kind in (("eagle", "feature"), ("medusa", "medusa"), ("dflash", "dflash"),
                     ("pard", "parallel")):
    if name in paths:
      specs[name] = run_lib.DraftKind(kind, path=paths[name])
  known = ["vanilla"] + list(specs) + ["block", "tree"]
  names = _method_names(options.methods, known)
  methods_lib.check_names(names, known, "this gin configuration (evaluation_drafts.drafts "
                          "and .paths name more)")
  for name in names[1:]:  # After vanilla.
    spec = specs.get(name, exp.draft)
    spec = getattr(spec, "inner", spec)
    if isinstance(spec, run_lib.ModelSpec):
      warning = spec.warn_on_other_tokenizer(tokenizer)
      if warning:
        raise ValueError(f"method {name!r}: {warning} (cross-tokenizer drafts are not "
                         "served by the harness)")
  target = run_lib.load_spec(exp.target, "target")
  if list(options.methods) in (["all"], []) and not family_of(target).supports_sparse_view:
    # 'all' means what this target can run; asked for by name, the draft says why not.
    names = [n for n in names if specs.get(n) is None or
             getattr(specs[n], "kind", None) != "sparse_cache"]
  return exp, tokenizer, target, specs, names


def _parse_gin(options: Options) -> None:
  """The launcher's gin files (--pair's configs/pairs file first) and bindings."""
  from experiments import run as run_lib
  parse_gin(run_lib.pair_gin_files(options.pair, options.gin_files), options.gin_bindings,
            options.gin_search_paths or (run_lib.REPO_ROOT,))


def _gin(options: Options, questions_rows):
  """(subject, methods) of a gin-configured target, its drafts built for it."""
  from experiments import run as run_lib
  from specdec_jax.drafts import TreeDraft
  exp, tokenizer, target, specs, names = _gin_subject(options)
  built = {}
  for name in names:
    if name == "vanilla":
      built[name] = Method("vanilla", None, 0, description=methods_lib.DEMO_METHODS["vanilla"])
      continue
    spec = specs.get(name, exp.draft)
    draft = spec.build(target, questions_rows(tokenizer), tokenizer)
    if name == "tree":
      draft = TreeDraft(draft, methods_lib.TREE_BRANCHING)
    built[name] = Method(name, draft, options.gamma, "block" if name == "block" else "token",
                         description=f"{type(draft).__name__} from {getattr(spec, 'name', name)}")
  template = getattr(tokenizer, "chat_template", None)
  files = [exp.target.checkpoint, exp.vocabulary] + [
      getattr(getattr(specs.get(n, exp.draft), "inner", specs.get(n, exp.draft)), field, None)
      for n in names for field in ("checkpoint", "path")]
  subject = runner.Subject(target, tokenizer, template,
                           getattr(tokenizer, "bos_token", None) or "",
                           getattr(tokenizer, "eos_token", None) or "")
  return subject, built, [f for f in dict.fromkeys(files) if isinstance(f, str)]


def _benchmark(options: Options, demo_path: Optional[str]) -> Benchmark:
  if options.benchmark == "demo":
    if demo_path is None:
      raise ValueError("--benchmark=demo is the demo pairs' mini-benchmark: pass --pair, or "
                       "name a benchmark file or dataset")
    source = demo_path
  elif options.benchmark == "table2":
    return _table2_benchmark(options)
  else:
    source = options.benchmark
  benchmark = benchmarks.load_benchmark(source, categories=options.categories,
                                        limit_per_category=options.limit_per_category)
  if options.benchmark == "demo":
    benchmark = dataclasses.replace(benchmark, name=f"demo mini-benchmark ({options.pair})")
  return benchmark


def _table2_benchmark(options: Options) -> Benchmark:
  """The paper's tasks as categories (configs/evaluate/table2.gin binds them)."""
  benchmark = benchmarks.task_benchmark(table2_tasks(), options.limit_per_category)
  if options.categories:
    missing = [c for c in options.categories if c not in benchmark.categories]
    if missing:
      raise ValueError(f"unknown categories {missing}; table2 has {benchmark.categories}")
    benchmark = dataclasses.replace(benchmark, questions=tuple(
        q for q in benchmark.questions if q.category in options.categories))
  return benchmark


@gin.configurable
def table2_tasks(tasks: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
  """Gin: Table 2's categories, {'ende': @ende/Task(), 'cnndm': @cnndm/Task()}."""
  if not tasks:
    raise ValueError(f"--benchmark=table2 needs its tasks: pass --gin_file={TABLE2_GIN} (it "
                     "binds table2_tasks.tasks)")
  return dict(tasks)


def _check_prompts(subject: runner.Subject, benchmark: Benchmark,
                   settings: runner.Settings) -> None:
  """Every first turn must fit the target (later turns grow with the answers: checked as
  they come)."""
  family, config = family_of(subject.target), subject.target.config
  decoder = runner.Decoder(subject, settings)
  for question in benchmark.questions:
    ids = runner.prompt_ids(subject, question.turns[:1], [])
    try:  # The family's own checks: width, positions (learned tables), token ids.
      inputs, lengths = decoder.inputs(ids)
      family.check_inputs(config, inputs, lengths, settings.max_new_tokens)
    except ValueError as e:
      raise ValueError(f"question {question.question_id} ({question.category}): {e}; lower "
                       "--max_new_tokens or drop the question (--categories)") from None


def _identity(options: Options, benchmark: Benchmark, methods: Dict[str, Method],
              settings: runner.Settings, files: Sequence[str]) -> Dict[str, Any]:
  """What decides the records: a rerun with the same identity resumes."""
  from experiments.run_identity import describe, fingerprint
  return dict(
      benchmark=dict(name=benchmark.name, source=benchmark.source,
                     questions=[dataclasses.asdict(q) for q in benchmark.questions]),
      methods={n: dict(draft=type(m.draft).__name__ if m.draft is not None else None,
                       gamma=m.gamma, verification=m.verification) for n, m in methods.items()},
      settings=dict(describe(settings), pair=options.pair, chat_template=options.chat_template,
                    # Only when set: unscaled runs keep their identity (and resume).
                    **({"scale_to": options.scale_to} if options.scale_to else {}),
                    gin_files=list(options.gin_files), gin_bindings=list(options.gin_bindings),
                    gin_config=gin.config_str() if options.pair not in PAIRS else None),
      backend=jax.default_backend(),
      files={path: fingerprint(path) for path in files})


def prepare(options: Options) -> Prepared:
  """The checked evaluation: benchmark, target, methods, settings, identity."""
  _check_options(options)
  notes = []
  if options.pair in PAIRS:
    subject, methods, demo_path, pair_steps, pair_dir = _demo(options)
    files = [pair_dir]
  else:
    _parse_gin(options)
    demo_path, pair_steps, files = None, None, []
  benchmark = _benchmark(options, demo_path)
  if options.pair not in PAIRS:
    first_turns = lambda tok: [tok.encode(q.turns[0]) for q in benchmark.questions]  # noqa
    subject, methods, files = _gin(options, first_turns)
  steps = options.max_new_tokens or pair_steps or SPEC_BENCH_MAX_NEW_TOKENS
  if options.max_new_tokens is None and pair_steps is not None:
    notes.append(f"max_new_tokens {steps}: what the demo pair was trained to write "
                 f"(Spec-Bench's {SPEC_BENCH_MAX_NEW_TOKENS} with --max_new_tokens)")
  subject, note = _resolve_template(subject, benchmark, options.chat_template)
  if note:
    notes.append(note)
  batch_size = options.batch_size or benchmark.concurrency or 1
  if options.batch_size is None and benchmark.concurrency:
    notes.append(f"batch_size {batch_size}: the benchmark's concurrency (--batch_size sets "
                 "another)")
  settings = runner.Settings(max_new_tokens=steps, repeats=options.repeats, batch_size=batch_size,
                             temperature=options.temperature, topk=options.topk,
                             topp=options.topp, seed=options.seed,
                             max_input_length=options.max_input_length,
                             width_factor=options.width_factor)
  _check_prompts(subject, benchmark, settings)
  for note in notes:
    logging.info("%s", note)
  return Prepared(subject, methods, benchmark, settings,
                  _identity(options, benchmark, methods, settings, files), tuple(notes))


def _resolve_template(subject: runner.Subject, benchmark: Benchmark, mode: str):
  """(the subject with its template or None, a note saying which) for `--chat_template`."""
  template = subject.template if mode == "auto" else None
  conversation.check_chat_template(benchmark, template, fallback_allowed=mode == "plain",
                                   tokenizer_name=getattr(subject.tokenizer, "source", None)
                                   or type(subject.tokenizer).__name__)
  subject = dataclasses.replace(subject, template=template)
  if template is None and benchmark.multi_turn:
    return subject, ("turns fed as plain text (--chat_template=plain): "
                     + conversation.PLAIN_DESCRIPTION)
  return subject, None
