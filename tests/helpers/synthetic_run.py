"""Synthetic run directories for the tests: a re-export of ``communities.tools.synthetic``.

``make_run`` moved into the package so that ``communities bench inspect`` can time
inspection on the same input the tests use; it imports nothing test-only (pytest,
conftest). The tests keep importing it from here.

Run as a script to make one: ``python tests/helpers/synthetic_run.py /tmp/run64 --ranks 64 --rounds 50``
(the same as ``python -m communities.tools.synthetic``).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from communities.tools.synthetic import first_appearance, main, make_run, planted_groups  # noqa: E402,F401

__all__ = ["first_appearance", "make_run", "planted_groups", "main"]

if __name__ == "__main__":
    sys.exit(main())
