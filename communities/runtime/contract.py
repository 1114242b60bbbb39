"""mypy's check that every world the engine may be handed fulfils ``view.WorldView``.

Each function below only returns its argument: under ``make lint`` mypy proves the class a structural subtype
of the protocol (a member missing, or of another signature, fails the lint). Kept apart from ``view.py`` so that
the contract imports none of the classes that fulfil it. ``GroupWorld`` and ``LeadView`` answer what they do not
define through ``__getattr__`` (an error naming the call, or the group's world), which mypy reads as any member:
for them it checks the members they define.
"""
from __future__ import annotations

from .comm import World
from .group_async import LeadView
from .groups import GroupWorld
from .population import ReplicaWorld
from .view import WorldView


def world(w: World) -> WorldView:
    return w


def replica_world(w: ReplicaWorld) -> WorldView:
    return w


def group_world(w: GroupWorld) -> WorldView:
    return w


def lead_view(w: LeadView) -> WorldView:
    return w


VIEWS = (World, ReplicaWorld, GroupWorld, LeadView)  # (the classes checked above, for the unit test)
