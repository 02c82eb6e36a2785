"""An evaluation's outputs: results.json (stable, scripted against), results.md, the plot.

results.json:
  {"benchmark": {name, source, categories, questions},
   "settings": {...}, "machine": {...},
   "methods": {NAME: {"categories": {CATEGORY: FIGURES}, "overall": FIGURES,
                      "description", "gamma", "verification", "block_width",
                      "compile_seconds", "law" (sampled: per category)}},
   "equality": {"checked": "greedy: ..." | "sampled: ...", "passed",
                "differing": {NAME: [{question_id, category, turn}]}}}
FIGURES (`metrics.group_figures`): speedup, speedup_spread {min, max, std},
  tau, alpha, tokens_per_s, seconds_per_input, prefill_seconds_per_input,
  new_tokens, target_calls, equal, total.
"""

import io
import os
import platform
from typing import Any, Dict, List, Sequence

import jax

from specdec_jax import results as results_lib
from specdec_jax.evaluation import law, metrics

RESULTS_JSON, RESULTS_MD, PLOT_PNG = "results.json", "results.md", "speedup_tau.png"
# The sampled law check's family false-alarm rate (all categories and methods together).
LAW_FALSE_ALARM = 0.01


def machine() -> Dict[str, Any]:
  """Where the run was timed."""
  device = jax.devices()[0]
  return dict(platform=jax.default_backend(), device=getattr(device, "device_kind", str(device)),
              devices=jax.device_count(), cpu_count=os.cpu_count(), host=platform.node(),
              python=platform.python_version(), jax=jax.__version__)


def _law(records, vanilla, categories, tests: int) -> Dict[str, Any]:
  return {c: law.law_check([r for r in records if r["category"] == c],
                           [r for r in vanilla if r["category"] == c], LAW_FALSE_ALARM, tests)
          for c in categories}


def assemble(methods, records: Dict[str, List[Dict[str, Any]]], benchmark,
             settings: Dict[str, Any], widths: Dict[str, int], greedy: bool) -> Dict[str, Any]:
  """results.json's object from every method's records."""
  categories = benchmark.categories
  vanilla = records["vanilla"]
  speculative = [n for n in methods if n != "vanilla"]
  out_methods, differing = {}, {}
  for name, method in methods.items():
    figures = metrics.method_figures(records[name], vanilla, categories)
    figures.update(description=method.description, gamma=method.gamma if name != "vanilla"
                   else 0, verification=method.verification, block_width=widths[name],
                   compile_seconds=sum(r.get("compile_seconds", 0.0) for r in records[name]))
    if not greedy and name != "vanilla":
      figures["law"] = _law(records[name], vanilla, categories,
                            tests=2 * len(categories) * max(len(speculative), 1))
    out_methods[name] = figures
    found = metrics.differing_outputs(records[name])
    if found:
      differing[name] = found
  if greedy:
    equality = dict(checked="greedy: every turn's tokens equal target-only decoding's at the "
                            "method's block width", passed=not differing, differing=differing)
  else:
    failed = {n: [c for c, v in m["law"].items() if not v["passed"]]
              for n, m in out_methods.items() if "law" in m}
    equality = dict(checked="sampled: per category, exact paired sign tests on the output "
                            "length and the target's mean log-probability, Bonferroni, "
                            f"family false-alarm rate {LAW_FALSE_ALARM}",
                    passed=not any(failed.values()),
                    failed={n: c for n, c in failed.items() if c})
  return dict(benchmark=dict(name=benchmark.name, source=benchmark.source,
                             categories=categories, questions=len(benchmark.questions)),
              settings=settings, machine=machine(), methods=out_methods, equality=equality)


def _fmt(value, spec: str, suffix: str = "") -> str:
  return "–" if value is None else f"{value:{spec}}{suffix}"


def _cell(figures: Dict[str, Any]) -> str:
  if figures["speedup"] is None:
    return "–"
  mark = "" if figures["equal"] in (None, figures["total"]) else " ✗"
  return f"{figures['speedup']:.2f}× · {figures['tau']:.2f}{mark}"


def markdown(result: Dict[str, Any]) -> str:
  """The paper-style table (speedup · τ per category), then each method's details."""
  categories = result["benchmark"]["categories"]
  head = ["method"] + categories + ["overall"]
  lines = [f"# {result['benchmark']['name']}: speedup · τ per category", "",
           "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name, m in result["methods"].items():
    cells = [_cell(m["categories"][c]) for c in categories] + [_cell(m["overall"])]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  lines += ["", "| method | α | c | C(W) | predicted | tokens/s | s per input | compile s "
            "| equal | γ | W | what |", "|" + "---|" * 12]
  for name, m in result["methods"].items():
    o = m["overall"]
    equal = "n/a (sampled)" if o["equal"] is None else f"{o['equal']}/{o['total']}"
    lines.append(f"| {name} | {_fmt(o['alpha'], '.3f')} | {_fmt(m.get('c'), '.3f')} "
                 f"| {_fmt(m.get('verify_cost'), '.2f')} "
                 f"| {_fmt(m.get('predicted_speedup'), '.2f', '×')} | {o['tokens_per_s']:.1f} "
                 f"| {o['seconds_per_input']:.3f} | {m['compile_seconds']:.1f} | {equal} "
                 f"| {m['gamma']} | {m['block_width']} | {m['description']} |")
  s, eq = result["settings"], result["equality"]
  vanilla = result["methods"]["vanilla"]["overall"]
  lines += ["", f"Speedup: the mean per-input tokens/s over vanilla's (Spec-Bench), each input's "
            f"figure the mean of {s['repeats']} repeats, methods interleaved input by input; "
            "compile time excluded (column 'compile s'). τ: tokens per target call. "
            "c: the draft's one-token step over the target's (– : no model of its own, "
            "taken as 0); C(W): the target's call on W tokens over one token; predicted: "
            "τ / (draft calls · c + C(W)), Theorem 3.8 at the measured τ. "
            f"Vanilla's prefill (the target's one-token decode): "
            f"{vanilla['prefill_seconds_per_input'] or 0:.4f} s per input. "
            f"Equality ({eq['checked']}): {'passed' if eq['passed'] else 'FAILED'}.",
            "", f"Settings: {s}", "", f"Machine: {result['machine']}"]
  return "\n".join(lines) + "\n"


def plot_png(result: Dict[str, Any]) -> bytes:
  """Speedup and τ per category per method, as grouped bars (matplotlib, PNG bytes)."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  categories = result["benchmark"]["categories"] + ["overall"]
  names = [n for n in result["methods"] if n != "vanilla"]
  figure, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(categories)) * 2, 4.5))
  width = 0.8 / max(len(names), 1)
  for ax, key, label in ((axes[0], "speedup", "speedup over vanilla"),
                         (axes[1], "tau", "τ (tokens per target call)")):
    for i, name in enumerate(names):
      m = result["methods"][name]
      values = [(m["overall"] if c == "overall" else m["categories"][c])[key] or 0
                for c in categories]
      ax.bar([j + i * width for j in range(len(categories))], values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories,
                  rotation=20)
    ax.set_ylabel(label)
  axes[0].legend(fontsize=8, ncol=2)
  figure.suptitle(f"{result['benchmark']['name']} ({result['machine']['platform']}, "
                  f"T = {result['settings']['temperature']})")
  figure.tight_layout()
  buffer = io.BytesIO()
  figure.savefig(buffer, format="png", dpi=100)
  plt.close(figure)
  return buffer.getvalue()


def write(output_dir: str, result: Dict[str, Any], plot: bool = True) -> Sequence[str]:
  """results.json, results.md and (with matplotlib) the plot, each atomically."""
  written = [os.path.join(output_dir, RESULTS_JSON), os.path.join(output_dir, RESULTS_MD)]
  results_lib.write_json_atomic(written[0], result)
  results_lib.write_text_atomic(written[1], markdown(result))
  if plot:
    try:
      png = plot_png(result)
    except ImportError:
      png = None  # Said by the caller: matplotlib is in the 'notebooks' extra.
    if png is not None:
      written.append(os.path.join(output_dir, PLOT_PNG))
      results_lib.write_bytes_atomic(written[-1], png)
  return written
