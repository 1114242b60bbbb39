"""What the loaders produce and the partitions hand out: a ``Dataset`` (with a text corpus's ``TextMeta``), each
rank's ``Shard`` of it, and which planted group a rank belongs to. Loading and partitioning live in data.py and,
for text corpora, text.py."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np


@dataclass
class Dataset:
    """A loaded data set: the training and test arrays, and what a partition or a report must know of them."""

    x_train: np.ndarray  # float32 (n, ...) features
    y_train: np.ndarray  # int64 (n,)
    x_test: np.ndarray
    y_test: np.ndarray
    name: str
    rank_groups: Optional[np.ndarray] = None  # declared by a user dataset: one group id per rank
    example_groups: Optional[np.ndarray] = None  # ... or one per training example
    sharded: bool = False  # a sharded reader's: x_train/y_train are this rank's shard, not the whole training set
    classes: Optional[int] = None  # set when the labels seen here may not cover every class (a sharded reader's)
    text: Optional[TextMeta] = None  # a text corpus's (text.py): x are token windows, y the next tokens

    @property
    def sequence(self) -> bool:
        """Whether examples are token windows and labels the next tokens (a language model's data)."""
        return self.text is not None

    @property
    def n_classes(self) -> int:
        if self.classes is not None:
            return self.classes
        return int(max(self.y_train.max(), self.y_test.max())) + 1

    @property
    def input_shape(self) -> Tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


@dataclass(frozen=True)
class TextMeta:
    """What the partitions and the reports need to know of a corpus."""

    domains: Tuple[str, ...]  # domain names, sorted
    window_domain: np.ndarray  # the domain id of every training window
    domain_bytes: np.ndarray  # training tokens per domain (bytes, for a byte corpus)
    bytes_per_token: Optional[float]  # 1 for bytes; a token corpus's only when data.lm.bytes_per_token is set
    source: str  # where it was read from, for the logs


@dataclass
class Shard:
    """A rank's training data plus the planted group it belongs to (or None)."""

    indices: np.ndarray  # into Dataset.x_train
    group: Optional[int]


def group_of_rank(rank: int, world: int, groups: int) -> int:
    """Contiguous blocks: ranks [0, N/G) are group 0, and so on."""
    return rank * groups // world
