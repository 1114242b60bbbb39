"""The SLURM tests' session fixture: a real one-node cluster (tests/helpers/slurm_cluster.py)."""
from tests.helpers.slurm_cluster import slurm_cluster  # noqa: F401  (registers the session fixture here)
