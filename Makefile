# Two entry points: `make demo` and `make test`. Each creates .venv and installs
# what it needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# CPU: float32 and no accelerator probing noise.
export JAX_PLATFORMS ?= cpu

# T5X integration (tests/test_t5x_integration.py): T5X's sources are not on
# PyPI; point T5X_PATH at the folder holding its t5x/ package. Its own venv,
# since tensorflow pins numpy/protobuf its own way.
T5X_PATH ?= ../shared/third_party
VENV_T5X := .venv-t5x

.PHONY: demo demo-methods evaluate test test-slow test-multihost test-t5x venv venv-test clean

# JAX's persistent compilation cache for the test targets: a program compiled once, by
# any test process (an xdist worker, a subprocess test, make test-slow after make test,
# a rerun), is read back instead of compiled again. Bounded (LRU, 4 GB, file-locked
# between processes). SPECDEC_JAX_CACHE= (empty) turns it off.
SPECDEC_JAX_CACHE ?= $(HOME)/.cache/specdec_jax/jax
ifneq ($(strip $(SPECDEC_JAX_CACHE)),)
JAX_CACHE_ENV := JAX_COMPILATION_CACHE_DIR=$(SPECDEC_JAX_CACHE) \
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.5 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 \
  JAX_COMPILATION_CACHE_MAX_SIZE=4000000000
endif

$(VENV)/.core: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.core setup.py
	$(PIP) install -q -e '.[test,parity,notebooks]'
	touch $@

venv: $(VENV)/.core
venv-test: $(VENV)/.test

# The demo in two acts (experiments/demo.py): the trained pairs as they are, then at a
# large model's cost. PAIR=both (default), t5 or decoder_only; MEMORY_GB: act 2's budget.
# Its compiled programs are cached like the tests' (a second run compiles nothing).
PAIR ?= both
MEMORY_GB ?= 4
demo: $(VENV)/.core
	$(JAX_CACHE_ENV) $(PY) -m experiments.demo --pair=$(PAIR) --memory_budget_gb=$(MEMORY_GB)

# Issue 22: chain (token-wise / block verification), static and dynamic token
# trees side by side at one block width on a demo pair (PAIR=decoder_only too; default t5).
demo-methods: $(VENV)/.core
	$(JAX_CACHE_ENV) $(PY) -m experiments.demo --pair=$(if $(filter both,$(PAIR)),t5,$(PAIR)) \
	  --acts=1 --methods=chain,block,tree,dynamic

# Issue 51: the standard evaluation (Spec-Bench's table: every method x every category,
# speedup, tau, equality) for both demo pairs on their shipped mini-benchmarks
# (demo_pair*/benchmark.jsonl), into EVAL_DIR/<pair>/ (results.json, results.md,
# speedup_tau.png); a rerun resumes. EVAL_FLAGS adds flags (--runs=1, --methods=...).
# --width_factor=4: prompts padded to 32, 128 or 512 tokens, so every method compiles two
# programs a pair, not three (a fresh machine spends most of the run compiling).
EVAL_DIR ?= results/evaluate
EVAL_FLAGS ?=
$(VENV)/.eval: $(VENV)/.core setup.py
	$(PIP) install -q -e '.[eval]'
	touch $@

evaluate: $(VENV)/.eval
	for pair in demo_t5 demo_decoder_only; do \
	  $(JAX_CACHE_ENV) $(PY) -m experiments.evaluate --pair=$$pair --benchmark=demo \
	    --chat_template=plain --width_factor=4 --output_dir=$(EVAL_DIR)/$$pair $(EVAL_FLAGS) \
	    || exit 1; \
	done

test: $(VENV)/.test
	$(JAX_CACHE_ENV) $(PY) -m pytest -q --timeout=900 -n 2 --dist loadgroup --durations=20 -m "not slow" \
	  --ignore=tests/test_multihost.py tests

# The long statistical and method suites (token trees, tree and block
# verification, feature drafts, the 8-device subprocesses, the Table 2 sweep,
# the GPU benchmark dry run, the notebooks, the second family or dtype of the
# heaviest equality tests): marked `slow`, run by CI beside `make test`, which
# they would take past its budget (12 minutes on 2 cores; a fresh machine
# compiles every program, a rerun reads most from the cache).
test-slow: $(VENV)/.test
	$(JAX_CACHE_ENV) $(PY) -m pytest -q --timeout=900 -n 2 --dist loadgroup --durations=20 -m slow \
	  --ignore=tests/test_multihost.py tests

# Two jax.distributed processes x 4 CPU devices on localhost against one
# 8-device process and the unsharded decode (tests/test_multihost.py). Its
# own target: its first compiles run slower across processes (54 s on the
# shared 2-core machine at load ~2 before per-host rows and the launcher run
# were added; back to back at load ~4-5, 143 s against 122 s for the version before).
test-multihost: $(VENV)/.test
	$(JAX_CACHE_ENV) $(PY) -m pytest -q --timeout=900 tests/test_multihost.py

$(VENV_T5X)/.t5x: setup.py
	$(PYTHON) -m venv $(VENV_T5X)
	$(VENV_T5X)/bin/pip install -q --upgrade pip
	$(VENV_T5X)/bin/pip install -q -e '.[test,t5x]'
	touch $@

test-t5x: $(VENV_T5X)/.t5x
	SPECDEC_T5X_PATH=$(abspath $(T5X_PATH)) PYTHONPATH=$(abspath $(T5X_PATH)) \
	  $(VENV_T5X)/bin/python -m pytest -q -rs --timeout=900 tests/test_t5x_integration.py

clean:
	rm -rf $(VENV) $(VENV_T5X) *.egg-info
