"""Per-rank weight snapshots at signature rounds (``output.round_snapshots``), for ``communities export``.

Opt-in: they cost N models per round. Each rank writes its own file, as it
does its checkpoint files (no gather to rank 0, which would hold N models at
once): ``snapshots/round_NNNN/rankRRRRR.pt``, a plain ``{"flat", "rank",
"round", "t", "n_params"}`` dict (``torch.load(path, weights_only=True)``),
where ``flat`` is the rank's weights as one float tensor in the model's
``state_dict`` order (parameters and floating buffers), taken at the round's
unit after that unit's merges. Written atomically; a failed write on any rank
stops every rank with the same DiskError.
"""
from __future__ import annotations

import io
from pathlib import Path

import torch

from ...errors import DiskError, collective
from ...results import atomic_write_bytes, disk_error
from ...runtime.view import WorldView

SNAPSHOTS_DIR = "snapshots"


def snapshot_path(run_dir: Path, round_index: int, rank: int) -> Path:
    return Path(run_dir) / SNAPSHOTS_DIR / f"round_{round_index:04d}" / f"rank{rank:05d}.pt"


class RoundSnapshots:
    """Writes this rank's weights at every signature round (a collective: the outcome is shared)."""

    def __init__(self, world: WorldView, run_dir: Path):
        self.world, self.run_dir = world, Path(run_dir)
        self.full = False  # fault injection (faults.disk_full_at)

    def save(self, round_index: int, t: int, flat: torch.Tensor, n_params: int) -> None:
        path = snapshot_path(self.run_dir, round_index, self.world.rank)
        buf = io.BytesIO()
        torch.save({"flat": flat.detach().cpu().clone(), "rank": self.world.rank, "round": round_index, "t": t,
                    "n_params": int(n_params)}, buf)
        try:
            atomic_write_bytes(path, buf.getvalue(), full=self.full)
            status = ""
        except OSError as exc:
            status = str(disk_error(path, exc))
        said = self.world.allgather_text(status, width=1024)
        failed = [m for m in said if m]
        if failed:
            more = f" (and on {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
            raise collective(DiskError(f"{failed[0]}{more}; the snapshots of round {round_index} were not written"))
