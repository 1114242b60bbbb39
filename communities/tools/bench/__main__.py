"""``python -m communities.tools.bench``: what ranks under ``mpiexec`` run (``exchange``, ``_signature-one``)."""
import sys

from .main import main_bench

sys.exit(main_bench())
