"""DP-SGD's arithmetic: per-example clipping factors, the noise scale, and (epsilon, delta) from Opacus.

Why here: clipping and noise are what make one replica's weights
(epsilon, delta)-differentially private with respect to its own shard, and the
accounting is what tells a user how much privacy each unit spends. The
accounting is Opacus's (``opacus.accountants``, Mironov's Renyi DP analysis of
the sampled Gaussian mechanism): this module only feeds it, and caches the
per-step Renyi divergences, which add up over steps (``compute_rdp`` with
``steps`` is ``steps`` times the one-step vector), so that an epsilon after
every unit costs microseconds instead of Opacus's 65 ms per call.

Opacus is an optional extra (``pip install -e '.[privacy]'``): it is imported
only when ``privacy.enabled`` is on (``workload.private.require_opacus`` makes a
missing install a clear error at start-up).
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Tuple

import numpy as np
import torch

ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))  # RDPAccountant.DEFAULT_ALPHAS


def _rdp():
    """Opacus's RDP analysis (an ImportError without opacus: ``workload.private.require_opacus`` says how to
    install it, at start-up)."""
    from opacus.accountants.analysis import rdp

    return rdp


def clip_factors(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Per-example factors ``min(1, C / ||g_i||)``: each scaled gradient has norm at most C.

    Exactly 1.0 where the bound does not bind, so that clipping nothing changes nothing
    (Opacus uses ``C / (||g|| + 1e-6)``, which rescales every example a little).
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    return torch.where(norms > max_norm, max_norm / norms.clamp_min(torch.finfo(norms.dtype).tiny),
                       torch.ones_like(norms))


def noise_std(noise_multiplier: float, max_norm: float) -> float:
    """The standard deviation of the Gaussian noise added to the *sum* of clipped gradients: sigma * C."""
    return float(noise_multiplier) * float(max_norm)


@functools.lru_cache(maxsize=256)
def _rdp_one_step(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    rdp = _rdp()
    out = rdp.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(ORDERS))
    out = np.asarray(out, dtype=np.float64)
    out.setflags(write=False)
    return out


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """(epsilon at ``delta``) after ``steps`` DP-SGD steps: equal to Opacus's ``RDPAccountant``.

    ``inf`` without noise (any step taken), 0 before the first step.
    """
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    rdp = _rdp()
    with warnings.catch_warnings():  # "optimal order is the largest alpha": a loose bound, still a valid one
        warnings.simplefilter("ignore", UserWarning)
        eps, _ = rdp.get_privacy_spent(orders=list(ORDERS), rdp=_rdp_one_step(float(noise_multiplier),
                                                                               float(sample_rate)) * int(steps),
                                       delta=delta)
    return float(eps)


@functools.lru_cache(maxsize=64)
def noise_for_epsilon(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The smallest noise multiplier (to 0.01 in epsilon) that keeps ``steps`` steps within ``target_epsilon``:
    Opacus's ``get_noise_multiplier`` with the RDP accountant."""
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta,
                                              sample_rate=sample_rate, steps=int(steps), accountant="rdp",
                                              epsilon_tolerance=0.01))
        except ValueError as exc:  # "The privacy budget is too low."
            raise ValueError(f"no noise keeps {steps} steps at sampling rate {sample_rate:.4g} within epsilon "
                             f"{target_epsilon:g} at delta {delta:g} (Opacus: {exc})") from None


def plan(cfg, sample_rate: float, steps: int) -> Tuple[float, float]:
    """(noise multiplier, epsilon the planned steps will spend) from a PrivacyConfig.

    With ``epsilon`` set, the noise is derived for exactly the planned steps; with
    ``noise_multiplier`` set, the epsilon follows from it.
    """
    if cfg.epsilon is not None:
        sigma = noise_for_epsilon(cfg.epsilon, cfg.delta, sample_rate, steps)
    else:
        sigma = float(cfg.noise_multiplier)
    return sigma, epsilon(sigma, sample_rate, steps, cfg.delta)
