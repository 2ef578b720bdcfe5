"""One vocabulary across the commands: the same option has one name everywhere, every option
says what it is and its default, and an older spelling still works with one line saying the
new one (crosscheck.cli.parser)."""

from __future__ import annotations

import argparse

import pytest

from crosscheck.cli.outputs import output_file
from crosscheck.cli.parser import RENAMED, build_parser

COMMANDS = ("run", "verify", "bugs", "bench", "conformance", "export-vectors")


def _commands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: sub.choices[name] for name in COMMANDS}


def _visible(command: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options --help shows (positionals, --help and hidden old spellings aside)."""
    return [
        a
        for a in command._actions
        if a.option_strings
        and a.help != argparse.SUPPRESS
        and not isinstance(a, argparse._HelpAction)
    ]


def test_the_same_option_has_one_name_in_every_command() -> None:
    names = {
        name: {o for a in _visible(c) for o in a.option_strings} for name, c in _commands().items()
    }
    for command in ("run", "verify", "bugs"):
        assert "--fixtures" in names[command], command
    for command in ("run", "verify"):
        assert {"--world-sizes", "--accum-steps", "--device", "--platform"} <= names[command]
    for command in ("bugs", "conformance"):
        assert "--frameworks" in names[command], command
    for command in ("run", "verify", "bugs", "bench", "conformance"):
        assert "--json" in names[command], command
    # An old spelling is hidden where it is read; elsewhere it may name something else only
    # when that is not a list: verify's --framework is the one framework of the step.
    shown_old = {(n, o) for n, renamed in RENAMED.items() for o in names[n] & set(renamed)}
    assert shown_old == set(), shown_old
    assert "--framework" not in names["conformance"] | names["bugs"]


def test_every_option_says_what_it_is_and_its_default() -> None:
    missing = []
    for name, command in _commands().items():
        for action in _visible(command):
            option = action.option_strings[-1]
            if not action.help:
                missing.append(f"{name} {option}: no help")
                continue
            flag = isinstance(action, argparse._StoreTrueAction)
            output = action.type is output_file  # not given: nothing is written
            if not (flag or output or action.required) and "default" not in action.help.lower():
                missing.append(f"{name} {option}: its help does not say its default")
    assert missing == []


@pytest.mark.parametrize(
    ("argv", "dest", "value", "new"),
    [
        (["run", "--fixture", "seed"], "fixtures", ["seed"], "--fixtures"),
        (["run", "--accum", "1,2"], "accum_steps", [1, 2], "--accum-steps"),
        (
            ["verify", "--framework", "torch", "--step", "m:f", "--scheme", "t", "--accum", "2"],
            "accum_steps",
            [2],
            "--accum-steps",
        ),
        (["bugs", "--fixture", "packed"], "fixtures", ["packed"], "--fixtures"),
        (["conformance", "--framework", "trl"], "frameworks", ["trl"], "--frameworks"),
        (["conformance", "--setting", "grpo-bnpo"], "settings", ["grpo-bnpo"], "--settings"),
    ],
)
def test_an_old_spelling_still_works_and_says_its_new_name_once(argv, dest, value, new, capsys):
    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value
    old = next(a for a in argv if a in RENAMED[argv[0]])
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"crosscheck: {old} is now {new} (the old spelling still works)\n"


def test_a_bad_value_under_an_old_spelling_is_refused_under_the_new_name(capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["run", "--accum", "x"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "argument --accum-steps: expected comma-separated integers, got 'x'" in err
