"""Data that moves, wired into the engine: confidence tracking, retirement, hard-example passing,
the least-recent partner policy, and functional (logits, CKA) signatures.

The pure parts, in process; the runs under a real mpiexec are in tests/mpi/test_moving_mpi.py."""
import numpy as np
import pytest
import torch

from communities.config import ConfigError, ExamplesConfig, apply_overrides, from_dict
from communities.core import partners, probe
from communities.engine.mixing import strategies
from communities.engine.replica import examples as example_tracker

pytestmark = pytest.mark.timeout(600)

# --------------------------------------------------------------------------- pure parts


def test_distance_factor_policies():
    assert example_tracker.distance_factor("none", 3.0, 1.0) == 1.0
    assert example_tracker.distance_factor("more_when_far", 1.5, 1.0) == 1.5
    assert example_tracker.distance_factor("more_when_near", 1.5, 1.0) == 0.5
    assert example_tracker.distance_factor("more_when_far", 9.0, 1.0) == 2.0  # clipped
    assert example_tracker.distance_factor("more_when_near", 9.0, 1.0) == 0.0
    assert example_tracker.distance_factor("more_when_far", 1.0, 0.0) == 1.0  # no scale: no change


def test_staleness_weights_prefer_unseen_shards():
    seen = np.array([[5, 5, -1], [0, 5, 4], [5, 1, 5]])
    W = np.array([partners.staleness_row(seen[i], i, t=5) for i in range(3)])
    assert np.all(np.diag(W) == 0)
    assert W[0, 2] > W[0, 1]  # rank 0's model never saw shard 2
    assert W[1, 0] > W[1, 2]  # saw shard 0 at t=0, shard 2 at t=4


def test_bias_steers_the_draw_and_stays_a_distribution():
    cfg = from_dict(apply_overrides({}, ["strategy=gossip", "merge.partner_policy=least_recent"]))
    s = strategies.make(cfg, 4)
    bias = np.ones((4, 4))
    bias[:, 3] = 1e6  # everyone should pick rank 3 when allowed
    np.fill_diagonal(bias, 0)
    s.bias = bias
    picks = [j for t in range(1, 60) for i, j in s.exchanges(t, np.array([0, 1, 2])) if i != 3]
    assert sum(j == 3 for j in picks) >= 0.95 * len(picks)


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))


def _permuted(model):
    """The same function with the hidden units permuted: far apart in weight space."""
    other = _mlp(0)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        other[0].weight.copy_(model[0].weight[perm])
        other[0].bias.copy_(model[0].bias[perm])
        other[2].weight.copy_(model[2].weight[:, perm])
        other[2].bias.copy_(model[2].bias)
    return other


@pytest.mark.parametrize("kind", ["logits", "cka"])
def test_functional_signatures_see_through_permuted_hidden_units(kind):
    x = torch.randn(40, 6, generator=torch.Generator().manual_seed(2))
    a, c = _mlp(0), _mlp(5)
    b = _permuted(a)
    signer = probe.ProbeSigner(kind, a, x, dim=16, seed=0)
    S = np.stack([signer(m) for m in (a, b, c)])
    w = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in (a, b)]
    assert float(torch.dist(w[0], w[1])) > 1.0  # the weights differ a lot
    if kind == "logits":
        assert np.allclose(S[0], S[1], atol=1e-5) and not np.allclose(S[0], S[2], atol=1e-2)
    else:
        d = signer.distances(S)  # condensed: (a,b), (a,c), (b,c)
        assert d[0] < 1e-6 and d[1] > 1e-3 and d[2] > 1e-3
        assert signer.exact and signer.k == 12  # the hidden layer (12 wide) fits: no projection
        assert np.array_equal(signer.distances(S), signer.distances(S.copy()))  # same bytes, same matrix


def test_probe_signer_names_a_bad_layer():
    with pytest.raises(ValueError, match=r"signature.layer='nope'.*valid names: \['0', '1', '2'\]"):
        probe.ProbeSigner("cka", _mlp(0), torch.randn(8, 6), dim=16, seed=0, layer="nope")


def test_examples_config_needs_tracking():
    with pytest.raises(ValueError, match="examples.retire=true needs examples.track=true"):
        ExamplesConfig(retire=True)
    with pytest.raises(ConfigError, match="examples.pass_hard"):
        from_dict(apply_overrides({}, ["examples.pass_hard=true"]))
