"""Experiment launchers: `run` (one target/draft pair on one task), `reproduce_table2`, `demo`."""
