"""Point-to-point message tags: one per kind of message, so no two can be confused."""
from __future__ import annotations

from enum import IntEnum


class Tag(IntEnum):
    """Point-to-point message tags: one per kind of message, so no two can be confused."""

    HEADER = 1  # the exchange header (merge metadata) partners swap before the weights
    WEIGHTS = 2  # the payload after the header: weights, optimizer moments, seen-at table (engine/mixing/exchange.py)
    EXAMPLE_COUNT = 5  # hard-example passing: how many examples each side sends
    EXAMPLE_FLOATS = 6  # ... their features and confidences
    EXAMPLE_INTS = 7  # ... their labels, ids, states and visited sets
    CONTROL = 9  # protocol async: pairing messages (kind, request id, unit, flags) and stop notices
    SIG_VERSIONS = 10  # protocol async: the versions of a rank's signature table
    SIGNATURES = 11  # protocol async: the signature rows a partner lacks
    VECTOR_SIZE = 12  # the length of a variable-length buffer that follows
    DISTANCE = 13  # the exchange's distance: each side's half of its squared norm (engine/mixing/exchange.py)


TAG_KINDS = 16  # message kinds (``Tag``) below this: a population's network tag is (src, dst, kind)
