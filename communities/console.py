"""What communities prints, through stdlib logging: one logger, ``communities``, that every module logs under.

INFO and below go to stdout, WARNING and above to stderr, each message as it is
(the texts start with ``communities:`` where they always did). Set up when the
package is imported, so a library user sees what the command line shows;
``communities run --quiet`` keeps warnings and errors only, ``--verbose`` adds debug lines.
"""
from __future__ import annotations

import logging
import sys

LOGGER = "communities"


class ConsoleHandler(logging.Handler):
    """The message to stdout (below WARNING) or stderr, looked up at each record (pytest's capsys is followed)."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def configure(quiet: bool = False, verbose: bool = False) -> None:
    """The ``communities`` logger's handler and level: --quiet shows warnings and errors, --verbose debug lines."""
    log = logging.getLogger(LOGGER)
    log.handlers[:] = [ConsoleHandler()]
    log.setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)
    log.propagate = False
