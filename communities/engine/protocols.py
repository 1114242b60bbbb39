"""The two protocols as sets of parts: which rounds, mixer and consensus a run is built from.

``virtual_clock`` (the default): every rank walks the same exchange lists and
signature rounds are collectives; deterministic and bitwise resumable.
``async``: each rank at its own pace; merges by request, served between
batches; signatures spread by gossip; no collective in the loop (a population:
each process at its own pace, its replicas together, ``async_population.py``). The loop
(``loop.py``) is the same for both: it asks the parts.
"""
from __future__ import annotations

from typing import NamedTuple

from ..config import Config
from ..core.protocol import RunningDigest
from ..runtime.group_async import LeadView
from ..runtime.groups import GroupWorld
from ..runtime.view import WorldView
from .mixing.async_groups import GroupFollowerMixer, GroupLeadMixer
from .mixing.async_mixer import AsyncMixer
from .mixing.async_population import PopulationMixer
from .mixing.async_posted import PostedMixer
from .mixing.mixer import Mixer
from .outcome.consensus import AsyncConsensus, Consensus
from .replica.replica import Replica
from .rounds.async_rounds import GossipRounds
from .rounds.signature_rounds import SignatureRounds
from .timer import Timer


class Parts(NamedTuple):
    rounds: SignatureRounds
    mixer: Mixer
    consensus: Consensus
    collective_log: bool  # may the run log gather rows at every round?


def build(cfg: Config, world: WorldView, timer: Timer, replica: Replica, agreement: RunningDigest) -> Parts:
    """The protocol-specific parts of a run (every rank calls it: set-up collectives)."""
    if cfg.protocol == "async":
        gossip = GossipRounds(cfg, world, timer, replica=replica, agreement=agreement)
        consensus = AsyncConsensus(cfg, world, timer, replica=replica)
        kind: type = PostedMixer if cfg.comm.exchange == "posted" else AsyncMixer
        view: object = world
        if world.processes < world.size:  # a population: pairs in a process merge in memory, across are posted
            kind = PopulationMixer
        if isinstance(world, GroupWorld):  # data-parallel groups: the lead mixes for its group, members follow
            kind, view = (GroupLeadMixer, LeadView(world)) if world.leads_group else (GroupFollowerMixer, world)
        mixer = kind(cfg, view, timer, replica=replica, agreement=agreement, table=gossip.table,
                     snapshots=consensus.snapshots)
        return Parts(gossip, mixer, consensus, collective_log=False)
    rounds = SignatureRounds(cfg, world, timer, replica=replica, agreement=agreement)
    return Parts(rounds, Mixer(cfg, world, timer, replica=replica, agreement=agreement),
                 Consensus(cfg, world, timer, replica=replica),
                 collective_log=True)
