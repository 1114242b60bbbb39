"""A process's replicas signed at once (``Signer.many``, engine/rounds/signature_rounds.py ``row_together``): the
count-sketch of (R, P) rows and the Gaussian sketch with each chunk of G drawn once for all rows give every row the
bits it gets alone; a plain (R, chunk) x (chunk, d) product would not (measured and stated, not used)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from communities.core import signature


@pytest.mark.parametrize("kind, n", [("countsketch", 3), ("countsketch", 1000), ("countsketch", 2 * 1024 + 17),
                                     ("gaussian", 5), ("gaussian", 3000)])
def test_rows_signed_at_once_have_each_rows_bits(kind, n):
    sk = signature.make_sketch(kind, n, 32, seed=1)
    if kind == "countsketch":  # a narrow view, so that rows, shifts and a tail are exercised on a small vector
        sk = signature.CountSketch(n, 32, seed=1, columns=1024)
    X = torch.randn(19, n, generator=torch.Generator().manual_seed(n))
    alone = torch.stack([sk(x) for x in X])
    many = sk.many(X, block=4) if kind == "countsketch" else sk.many(X)
    assert torch.equal(alone, many)
    signer = signature.Signer(sk, sk(X[0] * 0.5).numpy())
    assert np.array_equal(signer.many(X), np.stack([signer(x) for x in X]))


def test_a_plain_matmul_of_the_rows_is_close_but_not_promised_bitwise():
    sk = signature.make_sketch("gaussian", 3000, 32, seed=1)
    X = torch.randn(19, 3000, generator=torch.Generator().manual_seed(0))
    alone = torch.stack([sk(x) for x in X])
    diff = float((sk.many(X, matmul=True) - alone).abs().max() / alone.abs().max())
    assert diff <= 1e-5  # float32 sums in another order (measured: about 1e-6 of the largest entry)


def test_rows_of_another_length_are_refused():
    with pytest.raises(ValueError, match="rows of 10 entries"):
        signature.make_sketch("countsketch", 10, 8, seed=0).many(torch.zeros(3, 11))
