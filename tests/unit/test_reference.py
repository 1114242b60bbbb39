"""The docs' generated references (communities/tools/reference.py): current, complete, and stale when the code moves."""
from __future__ import annotations

import re
from pathlib import Path

from communities import cli, errors
from communities.config import Config, PbtRange, _all_keys
from communities.tools import reference

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_references_are_what_the_code_renders():
    assert reference.stale() == [], f"stale: run {reference.COMMAND}"


def test_a_changed_field_description_makes_the_config_reference_stale(monkeypatch):
    field = Config.model_fields["train"].annotation.model_fields["lr"]
    monkeypatch.setattr(field, "description", "a description nobody regenerated")
    assert "a description nobody regenerated" in reference.config_reference()
    assert reference.stale() == [reference.CONFIG_PAGE]


def test_a_changed_flag_help_makes_the_cli_reference_stale(monkeypatch):
    from communities.tools import compare

    build = compare.build_parser

    def changed():
        parser = build()
        parser.add_argument("--a-new-flag", action="store_true", help="added without regenerating")
        return parser

    monkeypatch.setattr(compare, "build_parser", changed)
    assert "added without regenerating" in reference.cli_reference()
    assert reference.stale() == [reference.CLI_PAGE]


def test_every_config_key_is_in_the_reference_with_a_description():
    page = (ROOT / reference.CONFIG_PAGE).read_text()
    leaves = [k for k in _all_keys(Config) if not reference.is_section(_field(k).annotation)]
    assert len(leaves) > 180
    for key in leaves:
        assert f"| `{key}` |" in page, key
        assert _field(key).description, f"{key} has no description in config.py: the reference would show none"
    for name in PbtRange.model_fields:  # a map of sections: pbt.params.<hyperparameter>.low/high/scale
        assert f"| `pbt.params.KEY.{name}` |" in page


def test_every_command_and_flag_is_in_the_cli_reference():
    page = (ROOT / reference.CLI_PAGE).read_text()
    commands = reference.command_parsers()
    assert [name for name, _, _ in commands][:2] == ["run", "validate"]
    assert {name for name, _, _ in commands} == {c.name for c in cli.COMMANDS}
    for _, _, parser in commands:
        assert f"## `{parser.prog}`" in page
        for action in parser._actions:
            if reference.shown(action) and action.option_strings:
                assert f"`{max(action.option_strings, key=len)}`" in page, (parser.prog, action.option_strings)


def test_the_pages_do_not_depend_on_the_terminal(monkeypatch):
    before = reference.cli_reference()
    monkeypatch.setenv("COLUMNS", "33")
    assert reference.cli_reference() == before


def test_markdown_escapes_outside_code_only():
    assert reference.cell("results/<name>/ | 2**32 `a|<b>`") == "results/&lt;name>/ \\| 2\\*\\*32 `a\\|<b>`"
    assert reference.type_text(Config.model_fields["world_size"].annotation) == "int or `null`"
    assert reference.range_text(Config.model_fields["seed"]) == "[0, 4294967296)"


def test_the_exit_codes_page_lists_every_exit_code():
    page = (ROOT / "docs" / "reference" / "exit-codes.md").read_text()
    codes = {name: value for name, value in vars(errors).items() if name.startswith("EXIT_")}
    assert len(codes) >= 5
    for name, value in codes.items():
        assert re.search(rf"\| `{value}` \| `{name}` \|", page), name


def _field(key: str):
    model, parts = Config, key.split(".")
    for part in parts[:-1]:
        model = model.model_fields[part].annotation
    return model.model_fields[parts[-1]]


def test_the_results_layout_page_names_every_summary_field_and_log_file():
    import dataclasses

    from communities.engine.record.runlog import LOG_FILES
    from communities.results import Summary

    page = (ROOT / "docs" / "reference" / "results-layout.md").read_text()
    for f in dataclasses.fields(Summary):
        assert f"`{f.name}`" in page, f"summary.json's {f.name} is not in docs/reference/results-layout.md"
    for name in LOG_FILES:
        assert f"`{name}`" in page, name
