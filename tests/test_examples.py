"""examples/*.py run as written, and README.md's Python blocks are those examples.

Each example runs in its own process (`python examples/X.py --target DIR --draft DIR`),
as a user runs it, against tiny random checkpoints that transformers writes here
(`save_pretrained`) with a `tokenizers` BPE tokenizer.json beside the target: the
examples read text through it and print decoded completions, and assert greedy
identity themselves. The feature-draft and Medusa examples use the shipped demo
pairs. Each README ```python block must equal one example's code (without its
docstring and argparse header), or say on its first line that it is not runnable.

Runtime (2 shared cores, load ~3): 52-65 s with JAX's persistent compilation cache
warm, 115-140 s cold. Compiles dominate (1-4 decode programs per example, 19 in all),
so the subprocesses share the cache (SPECDEC_JAX_CACHE, as `make test`) and use XLA's
cheap-compile flags; what is left is each process's import, load and tracing (3-10 s).
"""

import ast
import os
import re
import socket
import subprocess
import sys

import pytest

from specdec_jax import compile_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
README = os.path.join(REPO, "README.md")
NOT_RUNNABLE = "# Not runnable"
STEPS = 8
CORPUS = ["the cat sat on the mat and the dog sat on the log",
          "a quick brown fox jumps over the lazy dog",
          "translate English to German: The house is wonderful.",
          "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)"] * 4
VOCAB = 128
# Ids: <pad> 0, <s> 1, </s> 2 (T5: <pad> 0, </s> 1), in the models and the tokenizers.
ATTENTION = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)


def _models(transformers):
  """{family: a random tiny transformers model}. Sliding windows of 4, which the prompts
  and the loop run past; Gemma 2 alternates sliding and full layers."""
  t, ids = transformers, dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1,
                              eos_token_id=2)
  return {
      "t5": t.T5ForConditionalGeneration(t.T5Config(
          vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
          relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
          tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),
      "llama": t.LlamaForCausalLM(t.LlamaConfig(num_hidden_layers=1, **ATTENTION, **ids)),
      "gpt2": t.GPT2LMHeadModel(t.GPT2Config(
          vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=128, bos_token_id=1,
          eos_token_id=2)),
      "gemma2": t.Gemma2ForCausalLM(t.Gemma2Config(
          num_hidden_layers=2, head_dim=8, sliding_window=4, **ATTENTION, **ids)),
      "mistral": t.MistralForCausalLM(t.MistralConfig(
          num_hidden_layers=1, sliding_window=4, **ATTENTION, **ids)),
  }


# XLA's cheap compiles (as tests/test_multihost.py): a tiny model's programs compile
# in a fraction of the time and compute the same greedy tokens in each process.
CHEAP_COMPILES = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _tokenizer(path, family: str):
  """A BPE tokenizer.json on CORPUS with the family's special ids; Llama-like models
  get BOS from its post-processor (as Llama 3's), GPT-2 and T5 none."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  specials = ["<pad>", "</s>", "<unk>"] if family == "t5" else ["<pad>", "<s>", "</s>", "<unk>"]
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Metaspace()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=100, special_tokens=specials,
                                                      show_progress=False))
  if family not in ("t5", "gpt2"):
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
  tok.save(str(path))


def _randomize(model, family: str, noise: float, seed: int):
  """Wide random weights (HF's normal(0.02) init gives near-uniform logits, where
  greedy ties hide a wrong mask); `noise` > 0 perturbs them instead: a draft close
  enough to the target that some of its tokens are accepted."""
  import torch
  centre = 0.0 if family.startswith("gemma") else 1.0   # Gemma's norms compute 1 + w.
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      sample = torch.randn(param.shape, generator=generator)
      if noise:
        param.add_(noise * sample * param.abs().mean())
      elif name.endswith("bias"):
        param.copy_(0.1 * sample)
      elif "norm" in name or re.search(r"\bln_(1|2|f)\b", name):
        param.copy_(centre + 0.1 * sample)
      else:
        param.copy_(0.25 * sample)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """{family: [--target DIR --draft DIR]}: the target and a perturbed copy as its draft."""
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("torch")
  pytest.importorskip("tokenizers")
  root = tmp_path_factory.mktemp("checkpoints")
  out = {}
  for family, model in _models(transformers).items():
    model.eval()
    _randomize(model, family, noise=0.0, seed=0)
    target, draft = root / f"{family}_target", root / f"{family}_draft"
    model.save_pretrained(target)
    _tokenizer(target / "tokenizer.json", family)
    _randomize(model, family, noise=0.2, seed=1)
    model.save_pretrained(draft)
    out[family] = ["--target", str(target), "--draft", str(draft)]
  return out


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


# example -> its command-line arguments (besides --max_decode_steps).
RUNS = {
    "quickstart_t5.py": lambda c: c["t5"],
    "quickstart_decoder_only.py": lambda c: c["llama"],
    "gemma_mistral.py": lambda c: c["gemma2"],
    "trees_and_block.py": lambda c: c["mistral"],
    "feature_drafts.py": lambda c: [],
    "medusa.py": lambda c: [],
    "parallel_drafters.py": lambda c: [],
    "multihost.py": lambda c: c["gpt2"] + [
        "--coordinator_address", f"localhost:{_free_port()}", "--num_processes", "1",
        "--process_id", "0"],
    "first_call_cost.py": lambda c: c["llama"][:2],
}


def test_every_example_is_run_and_named_in_the_readme():
  with open(README, encoding="utf-8") as f:
    readme = f.read()
  names = sorted(n for n in os.listdir(EXAMPLES) if n.endswith(".py"))
  assert names == sorted(RUNS), "add the new example to RUNS"
  for name in names:
    assert f"examples/{name}" in readme, f"README.md does not name examples/{name}"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_example_runs(name, checkpoints):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=CHEAP_COMPILES)
  cache = compile_cache.cache_dir()   # as `make test`: later runs read the programs back
  if cache and "JAX_COMPILATION_CACHE_DIR" not in env:
    env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  command = [sys.executable, os.path.join("examples", name), *RUNS[name](checkpoints),
             "--max_decode_steps", str(STEPS)]
  result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, (f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n"
                                  f"{result.stderr[-6000:]}")
  # Every example prints decoded text: a list, a repr or a line per completion.
  assert re.search(r"'[^']*'", result.stdout), result.stdout


def _code_lines(source: str):
  """An example's non-blank lines without its docstring and its command-line header
  (`import argparse`, the parser, `args = parser.parse_args()`)."""
  body = ast.parse(source).body
  skip = set()
  if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
    skip.update(range(body[0].lineno, body[0].end_lineno + 1))
  for node in body:
    text = ast.get_source_segment(source, node)
    if text == "import argparse" or re.match(r"(parser\b|args = parser\.parse_args\(\))", text):
      skip.update(range(node.lineno, node.end_lineno + 1))
  return [line.rstrip() for i, line in enumerate(source.splitlines(), 1)
          if i not in skip and line.strip()]


def test_readme_python_blocks_are_the_examples():
  examples = {}
  for name in RUNS:
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as f:
      examples[name] = _code_lines(f.read())
  with open(README, encoding="utf-8") as f:
    blocks = re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)
  assert blocks
  shown = set()
  for block in blocks:
    lines = [line.rstrip() for line in block.splitlines() if line.strip()]
    if lines[0].startswith(NOT_RUNNABLE):
      continue
    matches = [name for name, code in examples.items() if code == lines]
    assert matches, ("a README.md python block is no example's code (update the example "
                     f"and the block together, or start it with {NOT_RUNNABLE!r}):\n{block}")
    shown.update(matches)
  assert shown == set(examples), f"examples no README block shows: {set(examples) - shown}"
