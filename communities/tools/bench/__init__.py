"""The benchmarks of ``communities bench``: one module per benchmark, the command line in ``main.py``."""
