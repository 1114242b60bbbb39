"""torch.optim called without importing torch._dynamo: the same numbers as torch's own calls."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from communities.workload import optim_calls


def _train(opt_name: str, mine: bool, steps: int = 6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optim_calls.step(opt) if mine else opt.step()
        assert torch.is_grad_enabled()  # the guard's grad mode is restored
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_the_step_is_torchs_bit_for_bit(opt_name):
    (mine, my_state), (theirs, their_state) = _train(opt_name, True), _train(opt_name, False)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    for key, value in their_state["state"][0].items():
        assert torch.equal(torch.as_tensor(my_state["state"][0][key]), torch.as_tensor(value))


def test_a_step_hook_still_runs():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    opt.register_step_post_hook(lambda *a: calls.append(1))
    model(torch.ones(1, 2)).sum().backward()
    optim_calls.step(opt)
    assert calls == [1]


def test_the_engine_optimizer_never_loads_the_compiler():
    """3.3 s of a rank's start-up: make_optimizer, step, zero_grad and a state dict's round trip import no
    torch._dynamo (its guards are marked disabled)."""
    code = ("import sys, torch; from types import SimpleNamespace as S; "
            "from communities.workload import optim_calls, train; "
            "m = torch.nn.Linear(3, 2); "
            "cfg = S(optimizer='sgd', lr=0.1, momentum=0.9, nesterov=False, weight_decay=0.0); "
            "o = train.make_optimizer(cfg, m.parameters()); m(torch.ones(1, 3)).sum().backward(); "
            "optim_calls.step(o); o.zero_grad(); o.load_state_dict(o.state_dict()); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False"]
