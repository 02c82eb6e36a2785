import os

# Tests run on CPU in float32; keep XLA from grabbing every core for one test.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
