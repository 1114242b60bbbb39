"""A saved model file (``consensus.pt``, ``models/community_<c>.pt``) read back as a ``state_dict``.

Why a module of its own: the report layer (communities/report/) never imports torch, yet the
notebook API's ``models()`` must hand back tensors. torch is imported here, inside the function,
only when a model is actually loaded, so opening a run and reading its frames needs no torch. A
file the run vouches for (its size and BLAKE2b digest in ``meta.json``'s ``files``) is checked
before it is unpickled, and every load is ``weights_only=True``: tensors and plain containers only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from . import manifest
from .errors import ResultsError


def load_state_dict(path: Path, expected: Optional[dict] = None, vouched_by: Optional[Path] = None) -> dict:
    """``torch.load(path, weights_only=True)`` on CPU, after checking ``expected`` (a manifest entry) if given.

    Raises ResultsError naming the file when it is missing, differs from its manifest entry
    (``vouched_by`` names the file holding that entry) or is not a state_dict torch can read.
    """
    path = Path(path)
    if expected is not None:
        why = manifest.file_mismatch(path, expected)
        if why is not None:
            where = f"; compared with {vouched_by}" if vouched_by is not None else ""
            raise ResultsError(f"{path}: damaged ({why}{where})")
    if not path.is_file():
        raise ResultsError(f"{path}: missing")
    try:
        import torch
    except ImportError:
        raise ResultsError(f"{path}: torch is needed to load a model (the frames and trees need none)") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle.UnpicklingError, RuntimeError (a zip archive torch cannot read), EOFError
        raise ResultsError(f"{path}: damaged ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
    if not isinstance(state, dict):
        raise ResultsError(f"{path}: damaged (expected a state_dict, got {type(state).__name__})")
    return state
