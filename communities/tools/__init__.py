"""Operator tools around the engine: benchmarks, comparisons, SLURM scripts, synthetic runs."""
