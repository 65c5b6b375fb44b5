"""``--help`` describes every flag of every subcommand, with its choices and the subcommand's own
defaults (issue 36). A flag added without a description fails here."""

import argparse
import re

import pytest

from shardwise.cli import TRACE_DEFAULTS, _parser


def subparsers():
    p = _parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("name", sorted(subparsers()))
def test_every_flag_of_every_subcommand_has_a_description(name):
    sp = subparsers()[name]
    bare = []
    for a in sp._actions:
        if isinstance(a, argparse._HelpAction) or a.help == argparse.SUPPRESS:
            continue
        text = re.sub(r"\(default:[^)]*\)", "", a.help or "").strip()
        if not text:
            bare.append("/".join(a.option_strings) or a.dest)
    assert not bare, f"shardwise {name}: flags without a description: {bare}"
    # the rendered help lists each choice of a flag that has choices
    out = sp.format_help()
    for a in sp._actions:
        for c in a.choices or ():
            assert str(c) in out, (name, a.option_strings, c)


def test_train_and_trace_show_their_own_defaults():
    train, trace = subparsers()["train"].format_help(), subparsers()["trace"].format_help()
    flat = lambda s: " ".join(s.split())  # noqa: E731 - argparse wraps lines
    assert "(default: small" in flat(train) and "(default: tiny" in flat(trace)
    assert f"(default: {TRACE_DEFAULTS['seq_len']})" in flat(trace)
    assert "(default: 128)" in flat(train)
    # every choice of --model's family is named in its line
    assert "mlp-tiny" in flat(train) and "moe-small" in flat(train)
