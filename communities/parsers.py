"""Argument parsing shared by the command line and the tools' own parsers (``communities bench``): a parser whose
errors list only the subcommands it shows, and help text from docstrings."""
from __future__ import annotations

import argparse
import re


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose error for an unknown subcommand lists what its help shows (``hide_subcommands``):
    internal subcommands stay callable without being offered to users."""

    def _check_value(self, action, value):
        shown = getattr(action, "shown", None)
        if shown is not None and action.choices is not None and value not in action.choices:
            raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from "
                                                 f"{', '.join(map(repr, shown))})")
        super()._check_value(action, value)


def plain_text(doc: str) -> str:
    """A docstring's first paragraph as help text: no reStructuredText markup (``code`` becomes code)."""
    return re.sub(r"``([^`]*)``", r"\1", doc.split("\n\n")[0])


def hide_subcommands(subparsers, *names: str) -> None:
    """Leave internal subcommands (still callable) out of ``--help``, the usage line and a ``Parser``'s errors."""
    # argparse prints ==SUPPRESS== for a subcommand whose help is SUPPRESS; its list of shown choices is private
    shown = [a for a in subparsers._choices_actions if a.dest not in names]
    subparsers._choices_actions = shown
    subparsers.shown = [a.dest for a in shown]
    subparsers.metavar = "{" + ",".join(subparsers.shown) + "}"
