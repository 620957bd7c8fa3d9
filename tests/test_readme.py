"""The README stays short, keeps its two commands, and its argument table follows ``TrainingMonitor.__init__``."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from lightning_monitor import TrainingMonitor
from lightning_monitor.monitor import DEFAULT_HALT_ON

README = Path(__file__).resolve().parent.parent / "README.md"
MAX_LINES = 250
#: The two command lines a fresh machine must be able to run as they are.
COMMANDS = (
    'pip install "torch==2.13.0" -e . && python examples/train_tiny_lm.py',  # the example needs no extra
    'pip install "torch==2.13.0" -e ".[test]" && python -m pytest',
)
ARGUMENTS_HEADING = "## Arguments"
TABLE_HEADER = ["Argument", "Default", "What it does"]
#: The one default the table may give by name instead of by ``repr``: the tuple is too long for a table cell.
NAMED_DEFAULTS = {"halt_on": ("DEFAULT_HALT_ON", DEFAULT_HALT_ON)}


def _lines() -> list[str]:
    return README.read_text(encoding="utf-8").splitlines()


def _cells(row: str) -> list[str]:
    """The cells of one Markdown table row (``|`` escaped as ``\\|`` stays inside its cell)."""
    inner = row.strip()
    if not (inner.startswith("|") and inner.endswith("|")):
        raise AssertionError(f"Not a table row: {row!r}")
    return [cell.strip().replace(r"\|", "|") for cell in re.split(r"(?<!\\)\|", inner[1:-1])]


def _argument_rows() -> list[list[str]]:
    """The rows of the first table under the arguments heading, header and separator left out."""
    lines = _lines()
    assert lines.count(ARGUMENTS_HEADING) == 1, f"README.md needs exactly one {ARGUMENTS_HEADING!r} heading"
    start = lines.index(ARGUMENTS_HEADING) + 1
    table: list[str] = []
    for line in lines[start:]:
        if line.startswith("#"):  # the next section: the table must come before it
            break
        if line.startswith("|"):
            table.append(line)
        elif table:  # the first line after the table
            break
    assert len(table) >= 2, f"No table under {ARGUMENTS_HEADING!r} in README.md"
    assert _cells(table[0]) == TABLE_HEADER
    assert all(set(cell) <= set("-: ") for cell in _cells(table[1])), "the second row must be the separator"
    rows = [_cells(line) for line in table[2:]]
    for row in rows:
        assert len(row) == 3, f"Expected 3 cells, got {row}"
    return rows


def _code(cell: str) -> str:
    """The text of a cell that is one code span, `like this`."""
    match = re.fullmatch(r"`([^`]+)`", cell)
    assert match, f"Expected one code span, got {cell!r}"
    return match.group(1)


def _parameters() -> list[inspect.Parameter]:
    return list(inspect.signature(TrainingMonitor.__init__).parameters.values())[1:]  # without `self`


def test_readme_is_short():
    assert len(_lines()) <= MAX_LINES, f"README.md has {len(_lines())} lines; move detail into docs/"


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_keeps_the_fresh_machine_commands(command):
    # The command starts its line and ends it, or a comment follows it.
    found = [line for line in _lines() if line.startswith(command)]
    assert any(not rest or rest.lstrip().startswith("#") for rest in (line[len(command) :] for line in found)), (
        f"README.md lost the command line {command!r}"
    )


def test_argument_table_names_every_argument_in_signature_order():
    names = [_code(row[0]) for row in _argument_rows()]
    assert names == [p.name for p in _parameters()]


def test_argument_table_gives_each_default_as_its_repr():
    parameters = {p.name: p for p in _parameters()}
    for row in _argument_rows():
        name, default = _code(row[0]), _code(row[1])
        parameter = parameters[name]
        assert row[2], f"`{name}` has no description"
        assert parameter.default is not inspect.Parameter.empty, f"`{name}` has no default: the table assumes one"
        if name in NAMED_DEFAULTS and default == NAMED_DEFAULTS[name][0]:
            assert parameter.default == NAMED_DEFAULTS[name][1], f"`{name}` no longer defaults to {default}"
            missing = [kind for kind in NAMED_DEFAULTS[name][1] if f"`{kind}`" not in row[2]]
            assert not missing, f"`{name}`: the row should say what {default} holds; it lacks {missing}"
            continue
        assert default == repr(parameter.default), f"`{name}`: README {default}, signature {parameter.default!r}"
