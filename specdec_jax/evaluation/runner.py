"""The evaluation's decodes: every method on every question, interleaved, timed, recorded.

For each question in the benchmark's order, each method decodes it `repeats`
times, the methods' order rotating from repeat to repeat, so that a machine's
drift (another process, a clock change, a cache warming) falls on every method
alike. A question of several turns is decoded turn by turn: each turn's prompt
is rendered from the turns and the method's own answers before it
(`conversation`). A program's first call, which compiles it, is made once
untimed before the timed calls (its excess over a timed call is the record's
`compile_seconds`).

Exactness is checked on every question: a method's greedy outputs must equal
target-only decoding's at the method's block width W, token for token (on
accelerators W is the same for both, so that reference is vanilla itself; on CPU
float32 target-only runs at W = 1 and a chain at gamma + 1, and the reference is
decoded apart, untimed). Sampled runs keep each repeat's statistics for
`law.law_check`.

A record (`store.RecordStore`) holds one method's decode of one question:
  runs          [repeats] {seconds, new_tokens, target_calls, drafted, accepted,
                beta_sum, beta_count}: lists over turns
  outputs       [turns] the answer ids of the first repeat; texts the same as text
  equal         greedy: every repeat's outputs equal the reference's (None: sampled)
  law_statistics sampled: per repeat {length (all turns), mean_log_prob (turn 1)}
  prefill_seconds vanilla: the target's prefill (a one-token decode) of every turn
"""

import dataclasses
import time
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from absl import logging
import jax
import numpy as np

from specdec_jax import settings as settings_lib
from specdec_jax import text
from specdec_jax.evaluation import conversation, law
from specdec_jax.evaluation.methods import Method
from specdec_jax.evaluation.questions import Benchmark, Question
from specdec_jax.families.registry import family_of
from specdec_jax.generation import generate
from specdec_jax.slots import generate_many

# Prompts are padded to one of these widths (then doubled), so that a benchmark's
# inputs share a few compiled programs.
MIN_WIDTH = 32


@dataclasses.dataclass(frozen=True)
class Settings:
  """How every method decodes.

  max_new_tokens: tokens per turn at most (Spec-Bench: 1024).
  repeats: timed decodes of each question per method (Spec-Bench: 3).
  temperature / topk / topp: sampling (temperature 0: greedy, Spec-Bench's).
  seed: the sampling keys' root (each method, question and repeat its own key).
  max_input_length: the widest prompt (tokens); a longer decoder-only prompt is an
    error, a longer T5 input is cut (T5's convention).
  batch_size: 1 (Spec-Bench): each question decoded alone by `generate`; more: each
    category's questions streamed through that many slots by `generate_many`, turn by
    turn, each call timed whole and its seconds shared among its inputs by their
    tokens (so every input of a call shows the call's tokens/s).
  width_factor: prompts are padded to 32 x width_factor^k tokens (`padded_width`): one
    compiled program per method and width.
  """
  max_new_tokens: int = 1024
  repeats: int = 3
  temperature: float = 0.0
  topk: int = 0
  topp: Optional[float] = None
  seed: int = 0
  max_input_length: int = 2048
  batch_size: int = 1
  width_factor: int = 2

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class Subject:
  """The target and how text reaches it.

  target: the model (any family); tokenizer: the target's (`encode`, `decode`).
  template: the tokenizer's chat template, or None (turns joined as plain text:
    `conversation`'s fallback).
  """
  target: Any
  tokenizer: Any
  template: Optional[str] = None
  bos_token: str = ""
  eos_token: str = ""

  @property
  def eos_id(self) -> int:
    return family_of(self.target).eos_id(self.target.config)


def prompt_ids(subject: Subject, turns: Sequence[str], answers: Sequence[str]) -> List[int]:
  """The token ids of the next turn's prompt (the template writes the special tokens)."""
  prompt = conversation.next_prompt(turns, answers, template=subject.template,
                                    bos_token=subject.bos_token, eos_token=subject.eos_token)
  if subject.template is not None:
    return list(subject.tokenizer.encode(prompt, add_special_tokens=False))
  return list(subject.tokenizer.encode(prompt))


def padded_width(length: int, cap: int, factor: int = 2) -> int:
  """The width a prompt of `length` ids is padded to: MIN_WIDTH times `factor` until it
  holds the prompt and its T5 EOS, at most `cap` (factor 4 compiles half the programs
  of factor 2 for a benchmark of varied lengths, and pads up to 4x)."""
  width = MIN_WIDTH
  while width < length + 1 and width < cap:
    width *= factor
  return min(width, cap)


def block_width(subject: Subject, method: Method, settings: Settings) -> int:
  """The target's block width W for `method` (`settings.plan_settings`' default)."""
  return settings_lib.plan_settings(
      subject.target.config, method.draft, max_decode_steps=settings.max_new_tokens,
      temperature=settings.temperature, topk=settings.topk, topp=settings.topp,
      gamma=max(method.gamma, 1), verification=method.verification,
      block_width=None).block_width


def method_key(seed: int, method: str, question_id: str, repeat: int):
  """The sampling key of one method, question and repeat (independent across all three)."""
  key = jax.random.fold_in(jax.random.PRNGKey(seed), zlib.crc32(method.encode()))
  key = jax.random.fold_in(key, zlib.crc32(str(question_id).encode()))
  return jax.random.fold_in(key, repeat)


@dataclasses.dataclass
class Decoder:
  """Decodes turns for one subject; remembers which programs it compiled."""
  subject: Subject
  settings: Settings
  clock: Callable[[], float] = time.perf_counter
  compiled: Dict[Tuple, float] = dataclasses.field(default_factory=dict)

  def inputs(self, ids: Sequence[int]):
    """(inputs [1, C], prompt_lengths [1] or None) of one prompt."""
    target = self.subject.target
    family, config = family_of(target), target.config
    width = padded_width(len(ids), self.settings.max_input_length, self.settings.width_factor)
    try:  # The family's convention: a prompt longer than the width is refused, T5 cuts.
      return family.text_inputs(config, [ids], width)
    except ValueError as e:
      raise ValueError(f"{e} (--max_input_length is {self.settings.max_input_length}: raise "
                       "it, or shorten the input)") from None

  def _kwargs(self, method: Method, rng, width: Optional[int]) -> Dict[str, Any]:
    kwargs = dict(temperature=self.settings.temperature, topk=self.settings.topk,
                  topp=self.settings.topp, rng=rng, block_width=width)
    if not method.is_vanilla:
      kwargs.update(draft=method.draft, gamma=method.gamma, verification=method.verification)
    return kwargs

  def _timed(self, key, decode):
    """(decode(), its seconds, compile seconds): a program's first call is made once
    untimed, and its excess over the timed call is what compiling cost."""
    first = None
    if key not in self.compiled:
      start = self.clock()
      np.asarray(decode().sequences)
      first = self.clock() - start
    start = self.clock()
    out = decode()
    np.asarray(out.sequences)  # Waits for the device.
    seconds = self.clock() - start
    compile_seconds = 0.0
    if first is not None:
      compile_seconds = self.compiled[key] = max(first - seconds, 0.0)
    return out, seconds, compile_seconds

  def call(self, method: Method, ids, steps: int, rng, width: Optional[int] = None):
    """One decode of `ids` by `generate`: (model inputs, output, seconds, compile s)."""
    inputs, lengths = self.inputs(ids)
    kwargs = dict(self._kwargs(method, rng, width), max_decode_steps=steps)
    out, seconds, compiling = self._timed(
        (method.name, inputs.shape, steps, width),
        lambda: generate(self.subject.target, inputs, lengths, **kwargs))
    return (inputs, lengths), out, seconds, compiling

  def many(self, method: Method, rows: Sequence[Sequence[int]], rng,
           width: Optional[int] = None):
    """The prompts `rows` through `batch_size` slots (`generate_many`), one timed call."""
    longest = max(rows, key=len)
    inputs, lengths = self.inputs(longest)
    target = self.subject.target
    inputs, lengths = family_of(target).text_inputs(target.config, rows, inputs.shape[1])
    kwargs = dict(self._kwargs(method, rng, width), max_decode_steps=self.settings.max_new_tokens,
                  batch_size=self.settings.batch_size)
    if method.is_vanilla:
      kwargs["gamma"] = 0
    out, seconds, compiling = self._timed(
        ("many", method.name, inputs.shape, width),
        lambda: generate_many(target, inputs, lengths, **kwargs))
    return (inputs, lengths), out, seconds, compiling

  def conversation(self, method: Method, question: Question, repeat: int,
                   width: Optional[int] = None, law_statistics: bool = False) -> Dict[str, Any]:
    """Every turn of `question` decoded by `method`: one run's counters, the answers."""
    run = _empty_run()
    answers, outputs, prompts, compile_seconds, first_log_prob = [], [], [], 0.0, None
    for turn in range(len(question.turns)):
      ids = prompt_ids(self.subject, question.turns[:turn + 1], answers)
      rng = jax.random.fold_in(method_key(self.settings.seed, method.name,
                                          question.question_id, repeat), turn)
      try:
        model_inputs, out, seconds, compiling = self.call(
            method, ids, self.settings.max_new_tokens, rng, width)
      except ValueError as e:
        raise ValueError(f"question {question.question_id} ({question.category}), turn "
                         f"{turn + 1} of {len(question.turns)}, {len(ids)} prompt tokens: "
                         f"{e}") from None
      compile_seconds += compiling
      length = int(np.asarray(out.lengths)[0])
      sequence = np.asarray(out.sequences)[0, :length]
      _count(run, out.stats, 0, seconds, length)
      outputs.append([int(t) for t in sequence])
      prompts.append(len(ids))
      answers.append(text.decode_rows(self.subject.tokenizer, np.asarray(out.sequences),
                                      np.asarray(out.lengths), self.subject.eos_id)[0])
      if law_statistics and turn == 0:
        first_log_prob = float(law.mean_log_probs(
            self.subject.target, *model_inputs, np.asarray(out.sequences),
            np.asarray(out.lengths), self.settings.max_new_tokens, self.settings.temperature,
            self.settings.topk, self.settings.topp)[0])
    return dict(run=run, outputs=outputs, texts=answers, prompt_tokens=prompts,
                compile_seconds=compile_seconds, first_log_prob=first_log_prob)

  def batched_conversations(self, method: Method, questions: Sequence[Question], repeat: int,
                            width: Optional[int] = None, law_statistics: bool = False
                            ) -> List[Dict[str, Any]]:
    """`conversation` for every question of `questions` at once: turn by turn, each turn
    of all of them one `generate_many` call, its seconds shared by their tokens."""
    decodes = [dict(run=_empty_run(), outputs=[], texts=[], prompt_tokens=[],
                    compile_seconds=0.0, first_log_prob=None) for _ in questions]
    key = method_key(self.settings.seed, method.name, questions[0].category, repeat)
    for turn in range(max(len(q.turns) for q in questions)):
      active = [i for i, q in enumerate(questions) if len(q.turns) > turn]
      rows = [prompt_ids(self.subject, questions[i].turns[:turn + 1], decodes[i]["texts"])
              for i in active]
      (inputs, lengths), out, seconds, compiling = self.many(
          method, rows, jax.random.fold_in(key, turn), width)
      out_lengths, sequences = np.asarray(out.lengths), np.asarray(out.sequences)
      texts = text.decode_rows(self.subject.tokenizer, sequences, out_lengths,
                               self.subject.eos_id)
      log_probs = (law.mean_log_probs(self.subject.target, inputs, lengths, sequences,
                                      out_lengths, self.settings.max_new_tokens,
                                      self.settings.temperature, self.settings.topk,
                                      self.settings.topp)
                   if law_statistics and turn == 0 else None)
      total = max(int(out_lengths.sum()), 1)
      for row, i in enumerate(active):
        length, decode = int(out_lengths[row]), decodes[i]
        _count(decode["run"], out.stats, row, seconds * length / total, length)
        decode["outputs"].append([int(t) for t in sequences[row, :length]])
        decode["texts"].append(texts[row])
        decode["prompt_tokens"].append(len(rows[row]))
        decode["compile_seconds"] += compiling / len(active)
        if log_probs is not None:
          decode["first_log_prob"] = float(log_probs[row])
    return decodes

  def prefill_seconds(self, question: Question, answers: Sequence[str]) -> float:
    """The target's prefill of every turn (a one-token target-only decode), timed."""
    vanilla, total = Method("vanilla"), 0.0
    for turn in range(len(question.turns)):
      ids = prompt_ids(self.subject, question.turns[:turn + 1], answers[:turn])
      total += self.call(vanilla, ids, 1, jax.random.PRNGKey(0))[2]
    return total


def _empty_run() -> Dict[str, List]:
  return {k: [] for k in ("seconds", "new_tokens", "target_calls", "drafted", "accepted",
                          "beta_sum", "beta_count")}


def _count(run: Dict[str, List], stats, row: int, seconds: float, length: int) -> None:
  """Appends one turn's counters of output row `row` to a run (vanilla, stats None: one
  target call per token)."""
  run["seconds"].append(seconds)
  run["new_tokens"].append(length)
  if stats is None:
    values = dict(target_calls=length, drafted=0, accepted=0, beta_sum=0.0, beta_count=0.0)
  else:
    values = dict(target_calls=int(stats.iterations[row]), drafted=int(stats.drafted[row]),
                  accepted=int(stats.accepted[row]), beta_sum=float(stats.beta_sum[row]),
                  beta_count=float(stats.beta_count[row]))
  for name, value in values.items():
    run[name].append(value)


def _first_difference(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]
                      ) -> Optional[int]:
  """The first turn (0-based) whose answer differs from the reference's, or None."""
  for turn, (mine, theirs) in enumerate(zip(outputs, reference)):
    if list(mine) != list(theirs):
      return turn
  return None if len(outputs) == len(reference) else min(len(outputs), len(reference))


def method_record(method: Method, question: Question, decodes: Sequence[Dict[str, Any]],
                  width: int, reference: Optional[Sequence[Sequence[int]]]) -> Dict[str, Any]:
  """One method's record of one question from its repeats' decodes (`Decoder.conversation`).

  reference: the reference outputs for greedy runs (None: sampled, no equality)."""
  first = decodes[0]
  record = dict(method=method.name, question_id=question.question_id,
                category=question.category, block_width=width,
                runs=[d["run"] for d in decodes], outputs=first["outputs"], texts=first["texts"],
                prompt_tokens=first["prompt_tokens"],
                compile_seconds=sum(d["compile_seconds"] for d in decodes))
  if reference is None:
    record.update(equal=None, law_statistics=dict(
        length=[float(sum(d["run"]["new_tokens"])) for d in decodes],
        mean_log_prob=[d["first_log_prob"] for d in decodes]))
    return record
  turns = [_first_difference(d["outputs"], reference) for d in decodes]
  differing = [t for t in turns if t is not None]
  record.update(equal=not differing, first_differing_turn=min(differing) if differing else None)
  return record


def reference_name(width: int) -> str:
  """The record name of target-only decoding at block width W (the equality reference)."""
  return f"target_only_w{width}"


def evaluate_question(decoder: Decoder, methods: Sequence[Method], question: Question,
                      widths: Dict[str, int], references: Dict[int, List[List[int]]],
                      rotation: int = 0) -> List[Dict[str, Any]]:
  """The records of `methods` on one question, their repeats interleaved.

  widths: each method's block width W; references: {W: target-only outputs at W}
  for the W's the methods need (greedy; filled in here for any W not yet decoded)."""
  settings, greedy = decoder.settings, decoder.settings.greedy
  vanilla_width = widths.get("vanilla")
  for width in sorted({widths[m.name] for m in methods} - {vanilla_width}):
    if greedy and width not in references:
      references[width] = decoder.conversation(Method(reference_name(width)), question, 0,
                                               width)["outputs"]
  decodes = {m.name: [] for m in methods}
  for repeat in range(settings.repeats):
    shift = (rotation + repeat) % len(methods)
    for method in list(methods[shift:]) + list(methods[:shift]):
      decodes[method.name].append(decoder.conversation(
          method, question, repeat, widths[method.name], law_statistics=not greedy))
  if greedy and vanilla_width is not None and "vanilla" in decodes:
    references.setdefault(vanilla_width, decodes["vanilla"][0]["outputs"])
  records = []
  for method in methods:
    width = widths[method.name]
    record = method_record(method, question, decodes[method.name], width,
                           references.get(width) if greedy else None)
    if method.is_vanilla:
      record["prefill_seconds"] = decoder.prefill_seconds(question,
                                                          decodes[method.name][0]["texts"])
    records.append(record)
  return records


def evaluate_category(decoder: Decoder, methods: Sequence[Method],
                      questions: Sequence[Question], widths: Dict[str, int],
                      references: Dict[int, List[List[List[int]]]]) -> List[Dict[str, Any]]:
  """`evaluate_question` for a category's questions decoded together (batch_size > 1):
  the records of `methods` on each question; references {W: [outputs per question]}."""
  settings, greedy = decoder.settings, decoder.settings.greedy
  vanilla_width = widths.get("vanilla")
  for width in sorted({widths[m.name] for m in methods} - {vanilla_width}):
    if greedy and width not in references:
      references[width] = [d["outputs"] for d in decoder.batched_conversations(
          Method(reference_name(width)), questions, 0, width)]
  decodes = {m.name: [] for m in methods}
  for repeat in range(settings.repeats):
    shift = repeat % len(methods)
    for method in list(methods[shift:]) + list(methods[:shift]):
      decodes[method.name].append(decoder.batched_conversations(
          method, questions, repeat, widths[method.name], law_statistics=not greedy))
  if greedy and vanilla_width is not None and "vanilla" in decodes:
    references.setdefault(vanilla_width, [d["outputs"] for d in decodes["vanilla"][0]])
  records = []
  for method in methods:
    width = widths[method.name]
    for i, question in enumerate(questions):
      reference = references[width][i] if greedy else None
      records.append(method_record(method, question, [d[i] for d in decodes[method.name]],
                                   width, reference))
  return records


def _resume_references(decoder: Decoder, widths, stored_vanilla):
  """The references a stored vanilla record already gives (greedy)."""
  if decoder.settings.greedy and stored_vanilla is not None:
    return {widths["vanilla"]: stored_vanilla}
  return {}


def run_benchmark(decoder: Decoder, methods: Dict[str, Method], benchmark: Benchmark,
                  store, progress: Optional[Callable[[int, int], None]] = None
                  ) -> Dict[str, List[Dict[str, Any]]]:
  """Every method on every question (resuming from `store`): {method: [records]}.

  batch_size 1: question by question; a question whose records are all stored is
  skipped, else the methods it lacks are decoded. batch_size > 1: category by
  category, the same way."""
  widths = {name: block_width(decoder.subject, m, decoder.settings)
            for name, m in methods.items()}
  stored = {(name, q.question_id): store.get(name, q.question_id)
            for name in methods for q in benchmark.questions}
  if decoder.settings.batch_size == 1:
    groups = [[q] for q in benchmark.questions]
  else:
    groups = list(benchmark.by_category().values())
  done = 0
  for index, group in enumerate(groups):
    missing = [methods[name] for name in methods
               if any(stored[name, q.question_id] is None for q in group)]
    if missing:
      vanilla = [stored.get(("vanilla", q.question_id)) for q in group]
      if len(group) == 1:
        references = _resume_references(decoder, widths, vanilla[0] and vanilla[0]["outputs"])
        new = evaluate_question(decoder, missing, group[0], widths, references, index)
      else:
        references = _resume_references(
            decoder, widths, None if None in vanilla else [v["outputs"] for v in vanilla])
        new = evaluate_category(decoder, missing, group, widths, references)
      for record in new:
        if record["method"] == "vanilla" and len(group) > 1:
          record["prefill_seconds"] = None  # Not timed apart within a stream of slots.
        store.put(record)
        stored[record["method"], record["question_id"]] = record
    done += len(group)
    if progress is not None:
      progress(done, len(benchmark.questions))
  logging.info("evaluated %d questions x %d methods", len(benchmark.questions), len(methods))
  return {name: [stored[name, q.question_id] for q in benchmark.questions] for name in methods}
