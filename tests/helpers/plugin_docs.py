"""docs/guides/own-model-and-data.md as the tests read it: its named code blocks and its worked example's commands."""
from __future__ import annotations

import re

from .mpi import ROOT

DOC = ROOT / "docs" / "guides" / "own-model-and-data.md"


def doc_blocks() -> dict:
    """The code blocks of docs/guides/own-model-and-data.md that name a file (```python title="PATH"), by path."""
    return {m.group(1): m.group(2) for m in re.finditer(r'```\w+ title="([^"]+)"\n(.*?)```', DOC.read_text(), re.S)}


def doc_commands() -> list:
    """The shell commands of docs/guides/own-model-and-data.md's worked example, as written."""
    block = re.search(r"Check it without MPI, then run it.*?```bash\n(.*?)```", DOC.read_text(), re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def doc_dry_run() -> list:
    """The lines docs/guides/own-model-and-data.md shows validate's dry run printing."""
    return re.search(r"prints the resolved config.*?```\n(.*?)```", DOC.read_text(), re.S).group(1).splitlines()
