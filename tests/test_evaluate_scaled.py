"""The evaluation harness with --scale_to: a demo pair at a large model's cost.

At tiny shapes (scripts/gpu_benchmarks.py's dry-run shapes, spelt as overrides): the
harness decodes the grown pair, its own greedy-equality check passes, results.json's
settings name the shape and vanilla's description says what was built; the
accelerator path (bfloat16: every loop at block width 8, the trees shrunk to fit) runs
on CPU; bad input is refused before any decode.
"""

import json

import pytest

from experiments import evaluate as evaluate_lib
from experiments import evaluate_setup as setup_lib
from specdec_jax import demo_pair
from specdec_jax.evaluation import methods as methods_lib
from specdec_jax.evaluation import runner

# gpu_benchmarks.py's DRY_SHAPES: the target at 2x the demo width, 6 + 6 layers; the
# 'small' draft and PARD's model at 2x theirs.
TINY_T5 = ("t5_1_1_xxl:emb_dim=512,num_heads=8,head_dim=64,mlp_dim=1536,num_encoder_layers=6,"
           "num_decoder_layers=6/t5_1_1_small:emb_dim=256,num_heads=2,head_dim=64,mlp_dim=512,"
           "num_encoder_layers=1,num_decoder_layers=2")
QUESTIONS = [
    dict(question_id=1, category="completion",
         turns=["import os\nimport sys\n\n\ndef main(argv):\n    path = argv[1]\n"]),
    dict(question_id=2, category="docstring_to_code",
         turns=["def add(a, b):\n    \"\"\"Returns the sum of a and b.\"\"\"\n"]),
]


def _benchmark(tmp_path, rows=QUESTIONS):
  path = tmp_path / "question.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def _options(tmp_path, methods, rows=QUESTIONS, **kwargs):
  return setup_lib.Options(pair="demo_t5", benchmark=_benchmark(tmp_path, rows),
                           methods=list(methods), max_new_tokens=16, repeats=1,
                           chat_template="plain", scale_to=TINY_T5, **kwargs)


def test_scaled_t5_pair_is_exact(tmp_path):
  """The grown target, the embedded 'small' draft and PARD model, the grown feature head."""
  prepared = setup_lib.prepare(_options(tmp_path, ["model", "eagle", "pard"]))
  target = prepared.subject.target
  assert (target.config.emb_dim, target.config.num_decoder_layers) == (512, 6)
  assert prepared.methods["model"].draft.model.config.emb_dim == 256
  assert prepared.methods["pard"].draft.model.config.emb_dim == 256
  assert prepared.methods["eagle"].draft.config.emb_dim == 512
  out = tmp_path / "out"
  result = evaluate_lib.evaluate(prepared, str(out), plot=False, costs=False)
  assert result["equality"]["passed"], result["equality"]
  assert result["methods"]["eagle"]["overall"]["equal"] == len(QUESTIONS)
  assert result["methods"]["model"]["overall"]["tau"] > 1
  written = json.loads((out / "results.json").read_text())
  assert written["settings"]["scale_to"] == TINY_T5
  described = written["methods"]["vanilla"]["description"]
  assert "9.7M demo target embedded at t5_1_1_xxl:" in described
  assert "small and parallel's model embedded at t5_1_1_small:" in described
  assert "feature, medusa, dflash grown with it" in described


@pytest.mark.slow  # make test budget (~50 s cold); the path scripts/gpu_benchmarks.sh takes
def test_accelerator_path_trees_fit_block_width_8(tmp_path, monkeypatch):
  """bfloat16 (the accelerators' dtype): every method scores blocks of 8, so the trees
  take the W = 8 shapes; greedy outputs still equal target-only decoding's."""
  monkeypatch.setattr(methods_lib, "scaled_dtype", lambda: "bfloat16")
  prepared = setup_lib.prepare(_options(tmp_path, ["tree", "dynamic_tree"], QUESTIONS[:1]))
  assert prepared.subject.target.config.dtype == "bfloat16"
  widths = {n: runner.block_width(prepared.subject, m, prepared.settings)
            for n, m in prepared.methods.items()}
  assert widths == {"vanilla": 8, "tree": 8, "dynamic_tree": 8}
  assert tuple(prepared.methods["tree"].draft.shape.branching) == methods_lib.FIXED_WIDTH_TREE
  result = evaluate_lib.evaluate(prepared, str(tmp_path / "out"), plot=False, costs=False)
  assert result["equality"]["passed"], result["equality"]


def test_decoder_only_scaled_pair_is_built():
  """The decoder-only pair at a gpt2 shape: its heads grown, its drafts as shipped (no
  draft shape named), every method it ships still there."""
  shape = "gpt2:emb_dim=384,num_heads=6,mlp_dim=1536,num_layers=6"
  pair = methods_lib.scale_demo_pair(
      demo_pair.load_demo_pair("decoder_only"), shape)[0]
  assert (pair.target.config.emb_dim, pair.target.config.num_layers) == (384, 6)
  shipped = demo_pair.load_demo_pair("decoder_only")
  assert pair.drafts["draft"].config == shipped.drafts["draft"].config
  assert pair.drafts["feature"].config == pair.target.config
  assert set(methods_lib.demo_builders(pair)) == set(methods_lib.demo_builders(shipped))


def test_scale_to_refused_before_decoding(tmp_path):
  with pytest.raises(ValueError, match="--scale_to embeds a demo pair's target"):
    setup_lib.Options(pair="local", scale_to="t5_1_1_xxl")
  with pytest.raises(ValueError, match="unknown shape 't5_1_1_huge'"):
    setup_lib.prepare(setup_lib.Options(pair="demo_t5", benchmark=_benchmark(tmp_path),
                                        methods=["model"], scale_to="t5_1_1_huge"))
