"""Root fixtures shared by every test folder (unit/, mpi/, slurm/); helpers live in tests/helpers/."""
from __future__ import annotations

from pathlib import Path

import pytest

from communities import console

# A config that trains in seconds: synthetic data, small MLP, 2 planted groups.
TINY = """
name: tiny
seed: 3
data:
  dataset: synthetic
  partition: label_groups
  groups: 2
  synthetic: {n_samples: 800, n_features: 16, n_classes: 4, class_sep: 3.0}
model: {name: mlp, hidden: [16]}
train: {optimizer: sgd, lr: 0.05, momentum: 0.9, batch_size: 32, unit: steps, steps_per_unit: 4, budget: 40,
        eval_every: 10}
merge: {lam: 2.0, rule: constant}
signature: {dim: 64, every: 5}
partners: {p_cross: {start: 0.05, end: 1.0, shape: linear, begin: 5, horizon: 20}}
consensus: {tol: 0.05, patience: 2, stop: false}
"""


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    """A config that trains in seconds: synthetic data, small MLP, 2 planted groups."""
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    return cfg


@pytest.fixture(autouse=True, scope="session")
def command_line_console():
    """The engine's messages printed as the command line prints them (``import communities`` leaves logging to
    the program; tests that run the engine in this process read its messages from stdout and stderr)."""
    console.configure()

