"""The command line from one table of subcommands, and the Python API's surface: ``__all__``, logging, one open_run."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

import communities
from communities import cli, results
from communities.tools.bench import main as bench
from tests.helpers.mpi import ROOT


def test_help_usage_and_dispatch_come_from_one_table(capsys):
    names = [c.name for c in cli.COMMANDS]
    assert names[:2] == ["run", "validate"] and len(set(names)) == len(names)
    parser = cli.build_parser()
    text = parser.format_help()
    flat = "".join(text.split())  # (argparse wraps the help at hyphens too)
    assert "communities" + "|".join(names) in flat  # the description names every command
    assert "{" + ",".join(names) + "}" in text  # the usage line
    for command in cli.COMMANDS:
        assert command.name in text and "".join(command.help_text.split())[:30] in flat
        if command.delegate:  # each delegate is a callable of an importable module
            module, function = command.delegate.split(":")
            assert callable(getattr(importlib.import_module(module, "communities"), function))
        else:
            assert command.handler is not None and command.arguments is not None
    with pytest.raises(SystemExit):
        cli.main(["nosuch"])
    err = capsys.readouterr().err
    assert all(repr(n) in err for n in names)


def test_bench_lists_its_table_and_keeps_its_internal_subcommands_out_of_help_and_errors(capsys):
    shown = bench.visible_benchmarks()
    assert shown == ["exchange", "signature", "clustering", "calibration", "partners", "overhead", "inspect",
                     "vectorize", "privacy", "scale", "chaos"]
    assert not set(bench.HIDDEN) & set(shown)
    help_line = next(c for c in cli.COMMANDS if c.name == "bench").help_text
    assert help_line == "benchmarks: bench " + " | ".join(shown)
    with pytest.raises(SystemExit) as exit_:
        bench.main_bench(["nosuch"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "invalid choice: 'nosuch'" in err
    assert all(repr(n) in err for n in shown) and not any(h in err for h in bench.HIDDEN)
    hidden = bench.build_parser().parse_args(["_signature-one", "--kind", "countsketch", "--params", "10"])
    assert hidden.what == "_signature-one"  # still callable


def test_run_refuses_resume_with_overwrite(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "configs/quickstart.yaml", "--resume", "--overwrite"])
    assert exit_.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def _python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return out.stdout.strip() + out.stderr.strip()


def test_import_leaves_the_programs_logging_alone():
    code = """
import io, logging
stream = io.StringIO()
logging.basicConfig(level=logging.INFO, stream=stream, format="%(name)s|%(message)s")
mine = logging.getLogger("communities")
before = (list(logging.getLogger().handlers), logging.getLogger().level, mine.level, mine.propagate)
import communities
after = (list(logging.getLogger().handlers), logging.getLogger().level, mine.level, mine.propagate)
logging.getLogger("communities.engine").info("a record")
print(before == after, [type(h).__name__ for h in mine.handlers], repr(stream.getvalue()))
"""
    assert _python(code) == "True ['NullHandler'] 'communities.engine|a record\\n'"


def test_all_names_the_public_api_and_each_name_resolves_lightly():
    code = ("import sys, communities as cx; [getattr(cx, n) for n in cx.__all__]; from communities import *; "
            "print(sorted(m for m in ('torch', 'mpi4py', 'pandas') if m in sys.modules))")
    assert _python(code) == "[]"
    public = {"open_run", "open_runs", "load_config", "Config", "ConfigError", "RunData", "Runs"}
    assert public <= set(communities.__all__)
    assert communities.open_run is importlib.import_module("communities.report.api").open_run
    assert communities.load_config("configs/quickstart.yaml").name == "quickstart"
    assert set(communities.__all__) <= set(dir(communities))
    assert not hasattr(results, "open_run")  # one open_run: the results module's reader is read_run
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        communities.nope  # noqa: B018
