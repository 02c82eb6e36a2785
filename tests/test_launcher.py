"""experiments.run for every family, text in and text out, and its bad-input errors.

Tiny random checkpoint pairs are written as Hugging Face directories
(`sj.export_hf`) with a tokenizer trained here: a `tokenizers` BPE
tokenizer.json (Llama and GPT-2 layouts), a SentencePiece tokenizer.model
with BOS and a chat template (Gemma 2), and a SentencePiece spiece.model (T5).
Each run's completions must equal what `sj.generate` plus the same tokenizer
give, batch for batch.
"""

import json
import os
import subprocess
import sys

import gin
import jax
import numpy as np
import pytest

import specdec_jax as sj
from experiments import run as run_lib
from specdec_jax import data
from specdec_jax import text as text_lib
from specdec_jax.families.decoder_only.config import DECODER_CONFIGS
from specdec_jax.families.registry import family_of

tokenizers = pytest.importorskip("tokenizers")

ROOT = run_lib.REPO_ROOT
CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "a quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target checks them",
    "one model drafts, the other model verifies every drafted token",
    "text in and text out with the checkpoint's own tokenizer",
    "hello world, hello again, and hello once more",
] * 4
PROMPTS = ["the cat sat on", "hello world", "a quick brown fox jumps over the lazy dog"]
WIDTH, STEPS, GAMMA, BATCH = 32, 8, 3, 2
SMALL = [f"MAX_INPUT_LENGTH = {WIDTH}", f"MAX_DECODE_STEPS = {STEPS}", f"GAMMA = {GAMMA}",
         f"BATCH_SIZE = {BATCH}", "Experiment.timing_repeats = 1"]
# Gemma 2's layout at test size: sandwich norms, soft-caps, a sliding layer
# whose window (4) the prompts and the loop run past. Gemma ids: pad 0, EOS 1, BOS 2.
GEMMA2_TINY = DECODER_CONFIGS["llama_tiny"].replace(
    family="gemma2", norm_offset=1.0, scale_embeddings=True, sandwich_norms=True,
    tie_word_embeddings=True, activation="gelu_new", sliding_window=4,
    layer_types=("sliding_attention", "full_attention"), query_pre_attn_scalar=16.0,
    attn_logit_softcap=50.0, final_logit_softcap=30.0, bos_id=2, eos_id=1, pad_id=0)


def _bpe(path, bos: bool, added: int = 0):
  """A BPE tokenizer.json on CORPUS: <pad> 0, <s> 1, </s> 2, <unk> 3 (llama_tiny's
  ids); `bos`: its post-processor adds <s> (as Llama 3's); `added` extra tokens."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Metaspace()
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=90, special_tokens=["<pad>", "<s>", "</s>", "<unk>"], show_progress=False))
  if bos:
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
  if added:
    tok.add_tokens([f"extra{i}" for i in range(added)])
  tok.save(str(path))
  return tok


def _random(config, seed: int):
  """A model of `config` (or a named config) with random normal weights, drawn on
  the host: a jitted init costs seconds of compile per shape, this nothing.
  Norm scales sit at 1 (Gemma's, which compute 1 + w, at 0)."""
  if isinstance(config, str):
    config = run_lib.named_config(config)
  family, rng = family_of(config), np.random.default_rng(seed)

  def leaf(path, shape):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    noise = rng.standard_normal(shape.shape)
    if "norm" in name and not name.endswith("bias"):
      return (1.0 - getattr(config, "norm_offset", 0.0) + 0.1 * noise).astype(shape.dtype)
    return (0.2 * noise).astype(shape.dtype)

  params = jax.tree_util.tree_map_with_path(leaf, family.abstract_params(config))
  return family.model_type(config, params)


def _write_pair(root, name, target_model, draft_model):
  dirs = []
  for role, model in (("target", target_model), ("draft", draft_model)):
    directory = root / f"{name}_{role}"
    sj.export_hf(model, str(directory))
    dirs.append(directory)
  return dirs


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
  """{name: (target dir, draft dir)} for llama, gpt2, gemma2 and t5 tiny pairs."""
  root = tmp_path_factory.mktemp("pairs")
  out = {}
  # One layer per model: compile time, not depth, is what these tests spend.
  one = dict(num_layers=1)
  llama = _write_pair(root, "llama", _random(DECODER_CONFIGS["llama_tiny"].replace(**one), 0),
                      _random("llama_tiny_draft", 1))
  _bpe(llama[0] / "tokenizer.json", bos=True)
  out["llama"] = llama
  gpt2 = _write_pair(root, "gpt2", _random(DECODER_CONFIGS["gpt2_tiny"].replace(**one), 0),
                     _random("gpt2_tiny_draft", 1))
  _bpe(gpt2[0] / "tokenizer.json", bos=False)  # GPT-2 adds no BOS.
  out["gpt2"] = gpt2
  gemma = _write_pair(root, "gemma2", _random(GEMMA2_TINY, 0), _random(GEMMA2_TINY.replace(
      num_layers=1, layer_types=("sliding_attention",)), 1))
  _sentencepiece(gemma[0] / "tokenizer.model", pad=0, eos=1, bos=2, unk=3)
  (gemma[0] / "tokenizer_config.json").write_text(json.dumps(dict(
      bos_token="<bos>", eos_token="<eos>", add_bos_token=True,
      chat_template="{{ bos_token }}{% for m in messages %}{{ m['role'] }}: "
                    "{{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}model:{% endif %}")))
  out["gemma2"] = gemma
  t5_one = sj.get_config("tiny").replace(num_encoder_layers=1, num_decoder_layers=1)
  t5 = _write_pair(root, "t5", _random(t5_one, 0),
                   _random(t5_one.replace(emb_dim=32, num_heads=2, mlp_dim=64), 1))
  tokenizer = data.train_tokenizer(CORPUS, vocab_size=300)  # T5 ids: pad 0, EOS 1, unk 2.
  (t5[0] / "spiece.model").write_bytes(tokenizer)
  out["t5"] = t5
  return out


def _sentencepiece(path, pad, eos, bos, unk):
  import io
  import sentencepiece as spm
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=80, model_type="unigram",
      pad_id=pad, eos_id=eos, bos_id=bos, unk_id=unk, pad_piece="<pad>", eos_piece="<eos>",
      bos_piece="<bos>", unk_piece="<unk>", hard_vocab_limit=False, num_threads=1,
      minloglevel=2)
  path.write_bytes(model.getvalue())


def _run(files, bindings, out):
  run_lib.parse_gin(files, SMALL + bindings)
  try:
    return run_lib.run_experiment(run_lib.Experiment(), str(out))
  finally:
    gin.clear_config()


def _input_file(tmp_path, prompts=PROMPTS):
  path = tmp_path / "prompts.jsonl"
  path.write_text("".join(json.dumps({"inputs": p}) + "\n" for p in prompts))
  return str(path)


def _api_texts(target_dir, draft_dir, encode, decode, prompts, t5: bool, width=WIDTH):
  """(baseline texts, speculative texts) from sj.generate + the tokenizer, in the
  launcher's batches (BATCH rows, the last padded with its final row)."""
  target, draft = sj.load_model(str(target_dir)), sj.load_model(str(draft_dir))
  eos = target.config.eos_id
  rows = [encode(p) for p in prompts]
  if t5:  # EOS ends the encoder input; longer inputs are cut, as T5 tasks do.
    rows = [r[:width - 1] + [eos] for r in rows]
  inputs = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    inputs[i, :len(r)] = r
  lengths = np.array([len(r) for r in rows], np.int32)
  texts = {"baseline": [], "speculative": []}
  for start in range(0, len(rows), BATCH):
    index = np.arange(start, min(start + BATCH, len(rows)))
    real = len(index)
    index = np.concatenate([index, np.repeat(index[-1:], BATCH - real)])
    for name, kwargs in (("baseline", {}), ("speculative", dict(draft=draft, gamma=GAMMA))):
      out = sj.generate(target, inputs[index], None if t5 else lengths[index],
                        max_decode_steps=STEPS, **kwargs)
      for seq, n in list(zip(np.asarray(out.sequences), np.asarray(out.lengths)))[:real]:
        ids = [int(t) for t in seq[:n]]
        texts[name].append(decode(ids[:-1] if ids and ids[-1] == eos else ids))
  return texts["baseline"], texts["speculative"]


def _check_results(result, out, prompts=PROMPTS):
  assert result == json.loads((out / "results.json").read_text())
  for key in ("task", "draft", "temperature", "gamma", "alpha", "speedup", "predicted_speedup",
              "c", "identical_outputs", "markdown_row", "completions"):
    assert key in result, key
  assert result["identical_outputs"] is True and result["identical_fraction"] == 1.0
  assert result["gamma"] == GAMMA and result["num_examples"] == len(prompts)
  assert result["markdown_row"] in (out / "results.md").read_text()
  assert [c["input"] for c in result["completions"]] == prompts
  assert all(c["baseline"] == c["speculative"] for c in result["completions"])
  assert result["scheduling"] in ("slots", "batches") and result["tokens_per_s_speculative"] > 0
  if result["scheduling"] == "slots":
    assert all(0 < v <= 1 for v in result["slot_occupancy"].values())


def _hf_codec(path):
  tok = tokenizers.Tokenizer.from_file(str(path))
  return (lambda t: tok.encode(t).ids), (lambda ids: tok.decode(ids, skip_special_tokens=True))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hf_tokenizer_pairs(pairs, tmp_path, name):
  target_dir, draft_dir = pairs[name]
  out = tmp_path / "out"
  result = _run(["configs/pairs/local.gin", "configs/tasks/local_file.gin"],
                [f"TARGET_CHECKPOINT = '{target_dir}'", f"DRAFT_CHECKPOINT = '{draft_dir}'",
                 f"INPUT_FILE = '{_input_file(tmp_path)}'"], out)
  _check_results(result, out)
  assert result["family"] == "decoder_only"
  assert result["tokenizer"] == str(target_dir / "tokenizer.json")
  encode, decode = _hf_codec(target_dir / "tokenizer.json")
  baseline, speculative = _api_texts(target_dir, draft_dir, encode, decode, PROMPTS, t5=False)
  assert [c["baseline"] for c in result["completions"]] == baseline
  assert [c["speculative"] for c in result["completions"]] == speculative
  # The tokenizer's own specials: the Llama-style one adds BOS, GPT-2's none.
  assert [c["input_tokens"] for c in result["completions"]] == [len(encode(p)) for p in PROMPTS]
  assert (encode("hello")[0] == 1) == (name == "llama")
  assert any(c["speculative"] for c in result["completions"])  # Some text came out.


def test_gemma_pair_with_sentencepiece_and_chat_template(pairs, tmp_path):
  import sentencepiece as spm
  target_dir, draft_dir = pairs["gemma2"]
  out = tmp_path / "out"
  prompts = ["hello", "the cat"]
  width = WIDTH
  result = _run(["configs/pairs/local.gin", "configs/tasks/local_file.gin"],
                [f"TARGET_CHECKPOINT = '{target_dir}'", f"DRAFT_CHECKPOINT = '{draft_dir}'",
                 f"INPUT_FILE = '{_input_file(tmp_path, prompts)}'", "CHAT_TEMPLATE = True",
                 f"MAX_INPUT_LENGTH = {width}"], out)
  _check_results(result, out, prompts)
  sp = spm.SentencePieceProcessor(model_file=str(target_dir / "tokenizer.model"))
  chat = "user: {}\nmodel:"
  # The template writes "<bos>" as text; as HF's Gemma tokenizer does, it becomes
  # BOS id 2, and no second BOS is added.
  encode = lambda p: [2] + sp.encode(chat.format(p))  # noqa: E731
  tokenizer = text_lib.read_tokenizer(str(target_dir))
  assert text_lib.encode_texts(tokenizer, prompts, chat=True) == [encode(p) for p in prompts]
  assert [c["input_tokens"] for c in result["completions"]] == [len(encode(p)) for p in prompts]
  baseline, speculative = _api_texts(target_dir, draft_dir, encode, sp.decode, prompts,
                                     t5=False, width=width)
  assert [c["speculative"] for c in result["completions"]] == speculative
  assert [c["baseline"] for c in result["completions"]] == baseline
  # Without the template: SentencePiece's BOS first, as tokenizer_config.json asks.
  assert tokenizer.encode("hello") == [2] + sp.encode("hello")


def test_t5_pair_with_trained_spiece(pairs, tmp_path):
  import sentencepiece as spm
  target_dir, draft_dir = pairs["t5"]
  out = tmp_path / "out"
  result = _run(["configs/pairs/local.gin", "configs/tasks/local_file.gin"],
                [f"TARGET_CHECKPOINT = '{target_dir}'", f"DRAFT_CHECKPOINT = '{draft_dir}'",
                 f"INPUT_FILE = '{_input_file(tmp_path)}'"], out)
  _check_results(result, out)
  assert result["family"] == "t5"
  sp = spm.SentencePieceProcessor(model_file=str(target_dir / "spiece.model"))
  # The random model also emits ids past the 300 pieces (T5's sentinel range):
  # they are not text, for the launcher as here.
  decode = lambda ids: sp.decode([i for i in ids if i < sp.get_piece_size()])  # noqa: E731
  baseline, speculative = _api_texts(target_dir, draft_dir, sp.encode, decode, PROMPTS,
                                     t5=True)
  assert [c["baseline"] for c in result["completions"]] == baseline
  assert [c["speculative"] for c in result["completions"]] == speculative


def _launch(args):
  # Cheap CPU compiles, as tests/test_experiments.py's launcher runs.
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_backend_optimization_level=0 "
                       "--xla_llvm_disable_expensive_passes=true")
  return subprocess.run([sys.executable, "-m", "experiments.run"] + args, cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def test_prompt_flag_with_a_draft_kind(pairs, tmp_path):
  """--prompt: one completion to stdout and the results; prompt lookup as the draft
  (no DRAFT_CHECKPOINT)."""
  target_dir, _ = pairs["llama"]
  out = tmp_path / "out"
  prompt = "the cat sat on the mat and the cat sat on"
  proc = _launch(["--pair=local", "--gin_file=configs/drafts/prompt_lookup.gin",
                  f"--gin.TARGET_CHECKPOINT='{target_dir}'", f"--prompt={prompt}",
                  f"--output_dir={out}"] + [f"--gin_bindings={b}" for b in SMALL])
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((out / "results.json").read_text())
  assert result["draft"] == "prompt_lookup" and result["identical_outputs"] is True
  assert result["task"] == "prompt" and len(result["completions"]) == 1
  completion = result["completions"][0]
  assert completion["input"] == prompt
  encode, _ = _hf_codec(target_dir / "tokenizer.json")
  assert completion["input_tokens"] == len(encode(prompt))
  # (Equality with the Python API is the in-process tests' check: this process
  # compiles with other XLA flags.)
  assert completion["speculative"] == completion["baseline"]
  assert proc.stdout.splitlines()[0] == completion["speculative"]
  assert result["markdown_row"] in proc.stdout


@pytest.mark.parametrize("name,gin_file,bindings,draft", [
    # A static tree around the pair's draft model.
    ("llama", "configs/drafts/tree.gin", ["TreeSpec.branching = (2, 1)", "BLOCK_WIDTH = 5"],
     "tree2x1(draft)"),
    # A dynamic tree around a bigram fitted on the inputs (no draft model);
    # BLOCK_WIDTH follows NODE_BUDGET.
    ("gpt2", "configs/drafts/dynamic_tree.gin",
     ["TreeSpec.inner = @DraftKind()", "DraftKind.kind = 'ngram'", "NODE_BUDGET = 6",
      "TreeSpec.topk = 2", "TreeSpec.depth = 3"], "dynamic_tree_k2d3n6(ngram)"),
])
def test_decoder_only_tree_drafts(pairs, tmp_path, name, gin_file, bindings, draft):
  """Tree drafts through gin on a decoder-only pair: greedy outputs equal target-only
  decoding at the tree's width; the tree's statistics reach results.json and results.md."""
  target_dir, draft_dir = pairs[name]
  out = tmp_path / "out"
  result = _run(["configs/pairs/local.gin", "configs/tasks/local_file.gin", gin_file],
                [f"TARGET_CHECKPOINT = '{target_dir}'", f"DRAFT_CHECKPOINT = '{draft_dir}'",
                 f"INPUT_FILE = '{_input_file(tmp_path)}'", "MAX_DECODE_STEPS = 10"] + bindings,
                out)
  assert result == json.loads((out / "results.json").read_text())
  assert result["family"] == "decoder_only" and result["draft"] == draft
  assert result["identical_outputs"] is True and result["identical_fraction"] == 1.0
  assert all(c["baseline"] == c["speculative"] for c in result["completions"])
  tree = result["tree"]
  assert result["block_width"] == tree["num_nodes"] == tree["block_width"]
  assert sum(result["depth_histogram"]) > 0
  assert len(result["depth_histogram"]) == tree["max_depth"] + 1
  # One gamma convention: a tree's gamma is its depth; the loop's deepest node (pending
  # tokens included) is max_depth, in results.json and in stats.summary() alike.
  assert result["gamma"] == tree["depth"] and tree["max_depth"] >= tree["depth"]
  assert result["operative_gin_config"]
  assert len(result["per_rank_acceptance"]) == 2 and result["mean_tokens_per_iteration"] >= 1
  if tree["kind"] == "dynamic_tree":
    assert tree["law"] == "topk" and result["expected_tokens_per_iteration"] is None
    assert result["predicted_speedup_note"].startswith("dynamic tree")
  assert "accepted-depth histogram" in (out / "results.md").read_text()


@pytest.mark.parametrize("name,gin_file,bindings,draft", [
    # A public-format EAGLE-1 head (written by the test) on the Llama pair, as a chain.
    ("llama", "configs/drafts/feature.gin", [], "feature"),
    # A random T5 feature head growing a static tree (no DRAFT_CHECKPOINT read).
    ("t5", "configs/drafts/feature_tree.gin", ["TreeSpec.branching = (2, 1)",
                                               "BLOCK_WIDTH = 5"], "tree2x1(feature)"),
    # One-call drafters (issue 32): a z-lab-format DFlash drafter (written by the test) on
    # the Llama pair; a random T5 DFlash drafter growing a tree; a PARD directory (the
    # pair's draft with a pard_token) on the Llama pair, chain and tree; random Medusa heads.
    ("llama", "configs/drafts/dflash.gin", ["GAMMA = 3"], "dflash"),
    ("t5", "configs/drafts/dflash_tree.gin", ["TreeSpec.branching = (2, 1)",
                                              "BLOCK_WIDTH = 5"], "tree2x1(dflash)"),
    ("llama", "configs/drafts/parallel.gin", ["GAMMA = 3"], "parallel"),
    ("llama", "configs/drafts/parallel_tree.gin", ["TreeSpec.branching = (2, 1)",
                                                   "BLOCK_WIDTH = 5"], "tree2x1(parallel)"),
    ("t5", "configs/drafts/medusa.gin", ["GAMMA = 3"], "medusa"),
])
def test_feature_drafts(pairs, tmp_path, name, gin_file, bindings, draft):
  """Feature drafts through gin: DraftKind 'feature' (an EAGLE directory, or a random
  head), alone and inside a tree; greedy outputs equal target-only decoding."""
  target_dir, draft_dir = pairs[name]
  if name == "llama" and "feature" in gin_file:
    head_dir = tmp_path / "eagle1"
    sj.save_feature_draft(sj.FeatureDraft(sj.load_model(str(target_dir)), seed=3), str(head_dir),
                          format="eagle1")
    bindings = bindings + [f"DraftKind.path = '{head_dir}'"]
  if name == "llama" and "dflash" in gin_file:
    head_dir = tmp_path / "dflash"
    sj.save_dflash_draft(sj.DFlashDraft(sj.load_model(str(target_dir)), block_size=4, seed=3),
                         str(head_dir))
    bindings = bindings + [f"DraftKind.path = '{head_dir}'"]
  if "parallel" in gin_file:
    pard_dir = tmp_path / "pard"
    drafter = sj.load_model(str(draft_dir))
    sj.export_hf(drafter, str(pard_dir))
    config = json.loads((pard_dir / "config.json").read_text())
    config["pard_token"] = drafter.config.vocab_size - 1
    (pard_dir / "config.json").write_text(json.dumps(config))
    bindings = bindings + [f"PARALLEL_DRAFTER = '{pard_dir}'"]
  out = tmp_path / "out"
  result = _run(["configs/pairs/local.gin", "configs/tasks/local_file.gin", gin_file],
                [f"TARGET_CHECKPOINT = '{target_dir}'", f"DRAFT_CHECKPOINT = '{draft_dir}'",
                 f"INPUT_FILE = '{_input_file(tmp_path)}'"] + bindings, out)
  assert result["draft"] == draft and result["identical_outputs"] is True
  assert all(c["baseline"] == c["speculative"] for c in result["completions"])
  assert result["alpha"] is not None


# ---------------------------------------------------------------------------
# Bad input: a clear error, and no results written.


def test_unknown_pair_name():
  with pytest.raises(ValueError, match=r"unknown pair 'llama_70b'.*known pairs:.*"
                                       r"gpt2_xl__gpt2.*llama_3_1_8b__llama_3_2_1b.*local"):
    run_lib.pair_gin_files("llama_70b", [])
  with pytest.raises(ValueError, match=r"unknown pair file 'configs/pairs/nope.gin'.*"
                                       r"qwen2_5_7b__qwen2_5_0_5b"):
    run_lib.pair_gin_files(None, ["configs/pairs/nope.gin"])


def test_prompt_with_an_input_file_is_an_error(pairs, tmp_path):
  target_dir, draft_dir = pairs["llama"]
  out = tmp_path / "out"
  proc = _launch(["--pair=local", "--gin_file=configs/tasks/local_file.gin",
                  f"--gin.INPUT_FILE='{_input_file(tmp_path)}'",
                  f"--gin.TARGET_CHECKPOINT='{target_dir}'",
                  f"--gin.DRAFT_CHECKPOINT='{draft_dir}'", "--prompt=hello",
                  f"--output_dir={out}"])
  assert proc.returncode == 1
  assert "--prompt and an input file" in proc.stderr and "prompts.jsonl" in proc.stderr
  assert not out.exists()
  proc = _launch(["--pair=no_such_pair", "--prompt=hello", f"--output_dir={out}"])
  assert proc.returncode == 1 and "unknown pair 'no_such_pair'" in proc.stderr
  assert not out.exists()


def test_missing_tokenizer_names_the_checkpoint(pairs, tmp_path):
  _, draft_dir = pairs["llama"]  # Exported without a tokenizer.
  out = tmp_path / "out"
  with pytest.raises(FileNotFoundError, match=rf"no tokenizer for the target checkpoint "
                     rf"{draft_dir}: it holds none of tokenizer.json, tokenizer.model, "
                     r"spiece.model, and VOCABULARY is not set"):
    _run(["configs/pairs/local.gin", "configs/tasks/local_file.gin"],
         [f"TARGET_CHECKPOINT = '{draft_dir}'", f"DRAFT_CHECKPOINT = '{draft_dir}'",
          f"INPUT_FILE = '{_input_file(tmp_path)}'"], out)
  assert not out.exists()
  # VOCABULARY supplies one (here the target's sibling), and then it runs.
  target_dir, _ = pairs["llama"]
  tokenizer = text_lib.checkpoint_tokenizer(str(draft_dir), str(target_dir))
  assert tokenizer.source == str(target_dir / "tokenizer.json")


def test_mismatched_tokenizer_names_both_files(pairs, tmp_path):
  target_dir, draft_dir = pairs["llama"]
  big = tmp_path / "big" / "tokenizer.json"
  big.parent.mkdir()
  _bpe(big, bos=True, added=40)  # Ids past llama_tiny's 97 embeddings.
  out = tmp_path / "out"
  with pytest.raises(ValueError, match=rf"vocabulary mismatch: {big} emits ids up to 1\d\d "
                     rf"but the target checkpoint {target_dir}/config.json has only 97"):
    _run(["configs/pairs/local.gin", "configs/tasks/local_file.gin"],
         [f"TARGET_CHECKPOINT = '{target_dir}'", f"DRAFT_CHECKPOINT = '{draft_dir}'",
          f"INPUT_FILE = '{_input_file(tmp_path)}'", f"VOCABULARY = '{big}'"], out)
  assert not out.exists()


@pytest.mark.parametrize("name,bindings,message", [
    # A prompt wider than the inputs: cutting it would change what it continues.
    ("llama", ["MAX_INPUT_LENGTH = 4"], r"input \d has \d+ tokens, more than the inputs' "
     r"width 4: MAX_INPUT_LENGTH is 4"),
    # GPT-2's learned positions: the longest prompt's L + 128 - 1 > 128 (real tokens; the
    # padded width 32 does not count).
    ("gpt2", ["MAX_DECODE_STEPS = 128"], r"the longest prompt \(\d+ tokens\) plus "
     r"max_decode_steps \(128\) needs \d+ positions .*this gpt2 model has 128 learned "
     r"positions"),
])
def test_prompt_longer_than_the_cache(pairs, tmp_path, name, bindings, message):
  target_dir, draft_dir = pairs[name]
  out = tmp_path / "out"
  with pytest.raises(ValueError, match=message):
    _run(["configs/pairs/local.gin", "configs/tasks/local_file.gin"],
         [f"TARGET_CHECKPOINT = '{target_dir}'", f"DRAFT_CHECKPOINT = '{draft_dir}'",
          f"INPUT_FILE = '{_input_file(tmp_path)}'"] + bindings, out)
  assert not out.exists()


@pytest.mark.parametrize("pair,target,draft", [
    ("llama_3_1_8b__llama_3_2_1b", "llama_3_1_8b", "llama_3_2_1b"),
    ("qwen2_5_7b__qwen2_5_0_5b", "qwen2_7b", "qwen2_0_5b"),
    ("gemma2_9b__gemma2_2b", "gemma2_9b", "gemma2_2b"),
    ("gpt2_xl__gpt2", "gpt2_xl", "gpt2")])
def test_named_pairs_name_their_shapes(pair, target, draft):
  run_lib.parse_gin(run_lib.pair_gin_files(pair, []),
                    ["TARGET_CHECKPOINT = '/t'", "DRAFT_CHECKPOINT = '/d'"])
  try:
    with gin.config_scope("target"):
      target_spec = run_lib.ModelSpec()
    with gin.config_scope("draft"):
      draft_spec = run_lib.ModelSpec()
  finally:
    gin.clear_config()
  assert target_spec.resolved_config() == DECODER_CONFIGS[target]
  assert draft_spec.resolved_config() == DECODER_CONFIGS[draft]
  assert (target_spec.checkpoint, draft_spec.checkpoint) == ("/t", "/d")


def test_named_pair_rejects_a_checkpoint_of_other_shapes(pairs, tmp_path):
  target_dir, draft_dir = pairs["llama"]
  with pytest.raises(ValueError, match=r"target checkpoint .* does not match the configured "
                     r"llama_3_1_8b shapes: .*embed.*checkpoint \(97, 64\) vs config "
                     r"\(128256, 4096\)"):
    _run(["configs/pairs/llama_3_1_8b__llama_3_2_1b.gin", "configs/tasks/local_file.gin"],
         [f"TARGET_CHECKPOINT = '{target_dir}'", f"DRAFT_CHECKPOINT = '{draft_dir}'",
          f"INPUT_FILE = '{_input_file(tmp_path)}'"], tmp_path / "out")
  assert not (tmp_path / "out").exists()


def test_padded_draft_vocabulary_keeps_outputs_exact(pairs):
  """Qwen2.5's 7B / 0.5B embedding tables differ in size around one tokenizer: a
  draft with fewer ids, its logits padded with -inf, still gives the target's
  greedy outputs. (The launcher's Llama target: its target-only program is compiled.)"""
  target = sj.load_model(str(pairs["llama"][0]))
  draft = _random(DECODER_CONFIGS["llama_tiny_draft"].replace(vocab_size=90), 1)
  prompts = np.zeros((BATCH, WIDTH), np.int32)
  prompts[0, :4], prompts[1, :2] = [1, 5, 6, 7], [1, 9]
  lengths = np.array([4, 2], np.int32)
  with pytest.raises(ValueError, match=r"the draft's vocabulary size 90 is smaller than the "
                     r"target's 97: .* pass draft=sj.ModelDraft\(draft, target_vocab_size=97\)"):
    sj.generate(target, prompts, lengths, max_decode_steps=STEPS, draft=draft)
  padded = sj.ModelDraft(draft, target_vocab_size=97)
  base = sj.generate(target, prompts, lengths, max_decode_steps=STEPS)
  spec = sj.generate(target, prompts, lengths, max_decode_steps=STEPS, draft=padded,
                     gamma=GAMMA)
  np.testing.assert_array_equal(np.asarray(base.sequences), np.asarray(spec.sequences))


# Fields that depend on the machine's timing: equal between runs only when read back.
TIMINGS = {"walltime_baseline_s", "walltime_speculative_s", "walltime_target_only_s", "speedup",
           "speedup_baseline_block_width", "target_step_ms", "draft_step_ms", "c",
           "target_verify_cost", "predicted_speedup", "predicted_speedup_measured_verify_cost",
           "markdown_row", "tokens_per_s_baseline", "tokens_per_s_speculative"}


def _counting_generate(monkeypatch, interrupt_at=None):
  """Counts generate's speculative calls; at call `interrupt_at` the process sends itself
  SIGINT (Ctrl-C) first."""
  import signal
  import threading
  import time
  calls = []
  if interrupt_at is not None and signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
    # The launcher relies on Python's own Ctrl-C (KeyboardInterrupt). A suite started in
    # the background without job control inherits SIGINT ignored, and an earlier test in
    # this worker may have left a handler of a library's: the test gets Python's back.
    signal.signal(signal.SIGINT, signal.default_int_handler)

  def counting(real):
    def decode(*args, **kwargs):
      if kwargs.get("draft") is not None:
        calls.append(1)
        if len(calls) == interrupt_at:
          if threading.current_thread() is threading.main_thread():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # The signal arrives as KeyboardInterrupt in here.
          raise AssertionError("SIGINT was not delivered")
      return real(*args, **kwargs)
    return decode

  # Both decoders the launcher runs: fixed batches (generate) and slots (generate_many).
  monkeypatch.setattr(run_lib, "generate", counting(sj.generate))
  monkeypatch.setattr(run_lib, "generate_many", counting(sj.generate_many))
  return calls


@pytest.mark.parametrize("scheduling", ["batches", "slots"])
def test_an_interrupted_run_resumes_to_the_same_results(pairs, tmp_path, monkeypatch,
                                                         scheduling):
  """Ctrl-C after the first batch (slots: the first chunk of 4 stashes' worth): a one-line
  message, no results, the batch kept; the same command then decodes only the missing
  batches and writes what an uninterrupted run writes (greedy); a finished run read again
  decodes nothing; another configuration in that directory is refused before any model
  loads."""
  target_dir, draft_dir = pairs["llama"]
  prompts = PROMPTS + ["the dog sat on the log", "hello again"]  # 3 batches of 2.
  if scheduling == "slots":
    prompts = prompts * 8  # 40 inputs in chunks of 4 stashes of max(2, 8): 32 + 8
  files = ["configs/pairs/local.gin", "configs/tasks/local_file.gin"]
  bindings = [f"TARGET_CHECKPOINT = '{target_dir}'", f"DRAFT_CHECKPOINT = '{draft_dir}'",
              f"INPUT_FILE = '{_input_file(tmp_path, prompts)}'",
              f"SCHEDULING = '{scheduling}'"]
  out = tmp_path / "out"
  # Speculative calls: the warm-up, batch 0, then batch 1 (interrupted).
  _counting_generate(monkeypatch, interrupt_at=3)
  with pytest.raises(run_lib.Interrupted) as stopped:
    _run(files, bindings, out)
  first = 2 if scheduling == "batches" else 32
  assert str(stopped.value) == (f"stopped after {first} of {len(prompts)} inputs; rerun the "
                                "same command to resume")
  assert not (out / "results.json").exists()
  assert sorted(os.listdir(out / "progress")) == ["batch_00000.npz", "identity.json"]

  calls = _counting_generate(monkeypatch)
  resumed = _run(files, bindings, out)
  assert len(calls) == 1 + (2 if scheduling == "batches" else 1)  # warm-up, the rest
  _check_results(resumed, out, prompts)

  whole = _run(files, bindings, tmp_path / "whole")
  assert {k: v for k, v in resumed.items() if k not in TIMINGS} == {
      k: v for k, v in whole.items() if k not in TIMINGS}

  calls = _counting_generate(monkeypatch)
  again = _run(files, bindings, out)
  assert calls == [] and again == resumed  # Every batch and timing read back.

  with pytest.raises(ValueError, match=r"holds a run of another configuration \("
                     r"experiment.gamma: 3 before, 2 now; gin: 'GAMMA = 3' before; "
                     r"gin: 'GAMMA = 2' now\): results of two configurations are never mixed"):
    _run(files, bindings + ["GAMMA = 2"], out)


def draft_with_another_tokenizer(draft_dir, tmp_path):
  """A copy of `draft_dir` whose own tokenizer.json (word level) encodes text otherwise."""
  import shutil
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  other = tmp_path / "other_draft"
  shutil.copytree(draft_dir, other)
  tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(
      vocab_size=90, special_tokens=["<pad>", "<s>", "</s>", "<unk>"], show_progress=False))
  tok.save(str(other / "tokenizer.json"))
  return other


def test_results_name_checkpoints_explain_columns_and_warn_on_another_tokenizer(pairs, tmp_path):
  """results.json names the checkpoints; results.md has a legend; a draft checkpoint whose
  own tokenizer encodes text differently is warned about (outputs stay exact)."""
  target_dir, draft_dir = pairs["llama"]
  other = draft_with_another_tokenizer(draft_dir, tmp_path)
  out = tmp_path / "out"
  run_lib.parse_gin(["configs/pairs/local.gin"], SMALL + [
      f"TARGET_CHECKPOINT = '{target_dir}'", f"DRAFT_CHECKPOINT = '{other}'"])
  try:
    exp = run_lib.prompt_experiment("the cat sat on the mat")
    result = run_lib.run_experiment(exp, str(out))
  finally:
    gin.clear_config()
  assert result["target_checkpoint"] == str(target_dir)
  assert result["draft_checkpoint"] == str(other)
  assert result["identical_outputs"] is True
  [warning] = result["warnings"]
  assert warning.startswith(f"the draft checkpoint's tokenizer ({other}/tokenizer.json) encodes "
                            f"text differently from the target's ({target_dir}/tokenizer.json)")
  assert "use a draft trained with the target's tokenizer" in warning
  markdown = (out / "results.md").read_text()
  assert "Columns: **temp** the sampling temperature" in markdown
  assert "**predicted** Theorem 3.8's speedup" in markdown


def test_gamma_auto_streams_in_phases_and_says_where_it_cannot_choose(pairs, tmp_path):
  """GAMMA='auto' (the default) with slots: generate_many chooses gamma per phase; greedy
  outputs stay the target's; results.json says the gamma of every phase and the measured
  costs it chose from. With fixed batches nothing chooses: gamma 4 ran, said in warnings."""
  target_dir, draft_dir = pairs["llama"]
  prompts = PROMPTS * 3
  files = ["configs/pairs/local.gin", "configs/tasks/local_file.gin"]
  bindings = [f"TARGET_CHECKPOINT = '{target_dir}'", f"DRAFT_CHECKPOINT = '{draft_dir}'",
              f"INPUT_FILE = '{_input_file(tmp_path, prompts)}'", "GAMMA = 'auto'"]
  result = _run(files, bindings, tmp_path / "slots")
  assert result["gamma_setting"] == "auto" and result["scheduling"] == "slots"
  assert result["identical_outputs"] is True
  phases = result["gamma_phases"]
  assert phases[0]["inputs"][0] == 0 and phases[-1]["inputs"][1] == len(prompts)
  assert all(a["inputs"][1] == b["inputs"][0] for a, b in zip(phases, phases[1:]))
  assert all(p["gamma"] in (0, 1, 2, 4) for p in phases)  # W = 5: gamma <= 4
  assert result["gamma"] in (1, 2, 4)
  # Target-only timed always; a speculative plan only where it could pay (a short stream).
  timed = set(result["gamma_auto_costs"]["iteration_ms"])
  assert "0" in timed and timed <= {"0", "1", "2", "4"}
  planning = result["gamma_auto_planning"]
  assert {str(g) for g in planning["timed"]} | set(planning["untimed"]) == {"0", "1", "2", "4"}
  assert planning["seconds"] > 0 and planning["calls"] >= 1
  # Said only where auto never speculated (this machine's timings may rule it out).
  spoke = any("GAMMA='auto' ran target-only throughout" in w for w in result["warnings"])
  assert spoke == (not any(p["gamma"] for p in phases))
  assert not any("chooses gamma between phases" in w for w in result["warnings"])
  fixed = _run(files, bindings + ["SCHEDULING = 'batches'"], tmp_path / "batches")
  assert fixed["gamma"] == 4 and fixed["gamma_phases"] is None
  assert any("GAMMA='auto' chooses gamma between phases" in w for w in fixed["warnings"])
