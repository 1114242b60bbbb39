"""The strategies that average over every rank: ``local_sgd``, ``diloco`` and ``allreduce``."""
from __future__ import annotations

from .strategy import Mixing, Strategy


class LocalSGD(Strategy):
    """Every rank takes the Allreduce mean of the weights every ``merge.period`` units."""

    name = "local_sgd"
    outer = False  # the mean is a pseudo-gradient for an outer step (diloco)

    def prepare(self, mixer: Mixing) -> None:
        if self.outer:
            mixer.enable_outer(anchor=True)

    def mix(self, t: int, mixer: Mixing) -> None:
        if t % self.cfg.merge.period == 0:
            mixer.average(t)


class DiLoCo(LocalSGD):
    """Local SGD whose global mean feeds an outer Nesterov step from the last global weights."""

    name = "diloco"
    outer = True


class Allreduce(Strategy):
    """Synchronous data parallelism: the flat gradient buffer is Allreduce-averaged at every step."""

    name = "allreduce"

    def prepare(self, mixer: Mixing) -> None:
        mixer.sync_gradients()
