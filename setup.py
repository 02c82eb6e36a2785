"""specdec_jax: exact speculative decoding in JAX/Flax (T5 and decoder-only families)."""
from setuptools import find_packages, setup

CORE = [
    "jax>=0.4.30",
    "flax>=0.8",
    "optax",
    "orbax-checkpoint",
    "numpy",
    "absl-py",
    "gin-config",
    "tensorstore",
    "msgpack",
    "tqdm",
    # The demo pair's tokenizer: `make demo` installs only the core.
    "sentencepiece",
]

EXTRAS = {
    # tokenizers / jinja2: the launcher's tests train a tokenizer.json and render a
    # chat template (tests/test_launcher.py).
    "test": ["pytest", "hypothesis", "scipy", "pytest-timeout", "pytest-xdist", "tokenizers",
             "jinja2", "pyarrow"],
    # Reference implementation for parity checks. torch is pinned to the CPU
    # wheel that this machine class carries.
    "parity": ["torch==2.13.0", "transformers", "safetensors", "sentencepiece"],
    # Text in, text out with a checkpoint's own tokenizer (experiments.run):
    # tokenizer.json through `tokenizers`, chat templates through jinja2.
    "tokenizer": ["sentencepiece", "tokenizers", "jinja2"],
    "data": ["tensorflow-datasets", "datasets", "pyarrow"],
    # The evaluation harness (experiments.evaluate, `make evaluate`): its plot, chat
    # templates, SPEED-Bench's parquet files.
    "eval": ["matplotlib", "jinja2", "pyarrow"],
    "notebooks": ["jupyter", "nbclient", "nbformat", "ipykernel", "matplotlib"],
    # What T5X's own sources (not on PyPI; see tests/test_t5x_integration.py)
    # import, for running T5X's binaries with our model. Kept out of .venv by
    # `make test-t5x`, which builds .venv-t5x: tensorflow pins its own numpy
    # and protobuf.
    "t5x": ["tensorflow-cpu", "seqio", "clu", "grain", "fiddle", "jaxtyping",
            "cached_property", "tensorboard", "jestimator"],
}

setup(
    name="specdec_jax",
    version="0.1.0",
    description="Exact speculative decoding in JAX/Flax: T5 and decoder-only targets, every draft kind",
    # experiments/: the launcher's entry points (`python -m experiments.run`), importable
    # from any directory once installed, not only from the repository root.
    packages=find_packages(include=["specdec_jax", "specdec_jax.*", "experiments",
                                    "experiments.*"]),
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require=EXTRAS,
)
