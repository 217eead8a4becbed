"""``kvsim policies``: every registered policy with its kind, summary and options; ``kvsim
policies NAME`` one policy's options (kind, default, choices, help), from the policy's own
``Params`` (there is no other copy)."""

import dataclasses
import json

from conftest import run_cli

from kvsim.policies import load_all
from kvsim.policies.base import FetchPolicy
from kvsim.policies.options import SHARED


def test_the_table_lists_every_policy_with_its_kind_and_options():
    code, out, err = run_cli("policies")
    assert code == 0 and err == ""
    lines = out.splitlines()
    at = lines[0].index("kind")  # the kind column
    rows = {line.split()[0]: line[at:].split()[0] for line in lines[1:]
            if line[:1].strip() and len(line) > at and line[at - 1] == " "}
    for name, cls in load_all().items():
        kind = "fetch" if issubclass(cls, FetchPolicy) else "mask"
        assert rows.get(name) == kind, name
        assert " ".join(cls.summary.split()[:3]) in " ".join(out.split()), name
    for f in ("token_budget", "sketch", "coef_bits"):
        assert f in out


def test_json_gives_every_policy_and_each_option_as_its_params_declares_it():
    code, out, _ = run_cli("policies", "--json")
    assert code == 0
    listed = {d["name"]: d for d in json.loads(out)}
    assert set(listed) == set(load_all())
    for name, cls in load_all().items():
        fields = dataclasses.fields(cls.Params)
        assert [o["name"] for o in listed[name]["options"]] == [f.name for f in fields]
        for o, f in zip(listed[name]["options"], fields):
            assert o["help"] == f.metadata.get("help", "") and o["default"] == f.default
            assert o["shared"] == (f.name in SHARED)
            assert o["choices"] == list(f.metadata.get("choices", ()))


def test_one_policy_lists_its_options_with_kind_default_and_choices():
    code, out, _ = run_cli("policies", "verkv")
    assert code == 0 and out.startswith("verkv, fetch: ")
    table = {line.split()[0]: line for line in out.splitlines() if line.startswith("sketch ")}
    assert "str" in table["sketch"] and "2bit" in table["sketch"]
    assert "2bit, bounded, perfect" in table["sketch"]
    assert "--policy verkv:KEY=VALUE" in out and "e.g. kvsim replay --policy verkv:" in out
    code, out, _ = run_cli("policies", "quest", "--json")
    d = json.loads(out)
    assert d["kind"] == "fetch" and {o["name"]: o["default"] for o in d["options"]}[
        "token_budget"] == 1024
    code, out, _ = run_cli("policies", "dense")  # an alias names its policy
    assert code == 0 and out.startswith("dense-resident (= dense), mask:")


def test_an_unknown_policy_is_one_line_and_exit_2():
    code, out, err = run_cli("policies", "h2o-nope")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [err.strip()] and "unknown policy 'h2o-nope'" in err


def test_the_example_each_policy_prints_runs_its_spec():
    """The e.g. line of every policy parses and validates (the spec form the page teaches)."""
    from kvsim.policies import parse
    for name in load_all():
        _, out, _ = run_cli("policies", name)
        line = [ln for ln in out.splitlines() if ln.startswith("e.g. kvsim replay --policy ")]
        if line:
            spec = line[0].split("--policy ")[1].split()[0]
            if "=VALUE" not in spec:
                parse(spec)
