"""The fused merge (core/fused_merge.py): bitwise ``lerp_``'s merge, the distance within rounding, on this
process's kernels and on the AVX2 kernels the golden runs pin."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from communities.core import fused_merge, merge
from tests.helpers.mpi import ROOT


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 15, 64, 1000, (1 << 15) + 1, 3 * (1 << 15) - 7])
def test_merge_blocks_is_bitwise_lerp_and_its_distance_is_exact_within_rounding(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g, dtype=dtype)
    y = x + torch.randn(n, generator=g, dtype=dtype) * 1e-3  # near consensus: the difference is small
    exact = float(torch.dist(x.double(), y.double())) ** 2
    for a in (0.0, 1e-4, 0.25, 1 / 3, 0.4999999, 0.5, 0.75, 0.9999, 1.0):
        want = x.clone()
        merge.interpolate_(want, y, a)
        for block in (64, 4096, fused_merge.MERGE_BLOCK):
            got = x.clone()
            sq = fused_merge.merge_blocks_(got, y, a, torch.empty(min(block, n), dtype=dtype))
            assert torch.equal(got, want), (a, block)
            assert sq == pytest.approx(exact, rel=1e-6)


def test_a_running_sum_over_pieces_on_block_boundaries_is_the_whole_sum_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(10_000, generator=g), torch.randn(10_000, generator=g)
    scratch = torch.empty(512)
    whole = fused_merge.merge_blocks_(x.clone(), y, 0.3, scratch)
    acc = 0.0
    for lo in range(0, 10_000, 2048):
        acc = fused_merge.merge_blocks_(x[lo:lo + 2048].clone(), y[lo:lo + 2048], 0.3, scratch, acc)
    assert acc == whole


def test_the_add_form_is_lerps_weight_in_the_tensors_precision():
    assert fused_merge.add_form(torch.float32, 0.25) == (False, 0.25)
    assert fused_merge.add_form(torch.float32, 0.7) == (True, float(torch.tensor(0.7) - 1))  # float32 arithmetic
    assert fused_merge.add_form(torch.float64, 0.7) == (True, 0.7 - 1.0)
    assert fused_merge.add_form(torch.bfloat16, 0.7) is None  # lerp computes in float: only lerp has its bits


CHECK = """
import torch
from communities.core import fused_merge, merge
assert fused_merge.add_matches_lerp(torch.float32) and fused_merge.add_matches_lerp(torch.float64)
g = torch.Generator().manual_seed(1)
for n in (7, 1000, 40_001):
    x, y = torch.randn(n, generator=g), torch.randn(n, generator=g)
    for a in (0.3, 0.5, 0.8):
        want = x.clone(); merge.interpolate_(want, y, a)
        got = x.clone(); fused_merge.merge_blocks_(got, y, a, torch.empty(min(n, 4096)))
        assert torch.equal(got, want), (n, a)
print(torch.backends.cpu.get_cpu_capability(), "OK")
"""


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_the_add_form_matches_lerp_on_the_pinned_kernels_too(capability):
    """The golden runs pin ATen to AVX2 (tests/helpers/golden_runs.py): the fused merge keeps their bits there."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("OK")
