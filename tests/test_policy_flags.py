"""Policy options as flags: one meaning per option name across every registered policy (a clash
is caught, shown here on made-up policies), help grouped by the policies that take each option,
and one check per shared option, the same for every policy."""

import argparse
import dataclasses
from dataclasses import dataclass, field

import pytest

from kvsim.commands._policy_flags import add_policy_flags
from kvsim.errors import KvsimError
from kvsim.policies import load_all, make
from kvsim.policies import options as O
from kvsim.policies.spec import clashes, flag

# every policy flag kvsim has shipped: none may disappear
FLAGS = {"--compression", "--eps", "--delta", "--scorer", "--sink", "--local", "--sketch",
         "--shrinkage", "--shortlist", "--pass-plan", "--eps-output", "--variant", "--coef-bits",
         "--group-size", "--quant-axis", "--basis", "--setting", "--mode", "--r-min",
         "--rank-cap", "--stride", "--anchors-c", "--window", "--obs-window"}


def _policy(name: str, params: type) -> type:
    return type(name, (), {"name": name, "Params": params})


def _groups(policies=None, lists=False) -> dict[str, dict[str, str]]:
    """{group title: {flag: help}} of the policy flags."""
    p = argparse.ArgumentParser()
    add_policy_flags(p, lists=lists, policies=policies)
    return {g.title: {a.option_strings[0]: a.help for a in g._group_actions}
            for g in p._action_groups if g.title not in ("positional arguments", "options")}


def _takers(policies: dict) -> dict[str, dict[str, dataclasses.Field]]:
    """{option: {policy: its field}}."""
    out: dict[str, dict] = {}
    for name, cls in policies.items():
        for f in dataclasses.fields(cls.Params):
            out.setdefault(f.name, {})[name] = f
    return out


def test_registered_policies_give_each_option_one_meaning():
    assert clashes(load_all()) == []


@dataclass
class _Window:
    window: int = field(default=64, metadata={"help": "recent tokens kept"})


@dataclass
class _OtherWindow:
    window: int = field(default=64, metadata={"help": "recent tokens kept"})


@dataclass
class _OwnCompression:
    compression: float = field(default=8.0, metadata={"help": "cache is this much smaller"})


@dataclass
class _SharedCompression:
    compression: float = O.compression_field(4.0)
    pages: int = field(default=16, metadata={"help": "tokens per page"})


@dataclass
class _OnlyCompression:
    compression: float = O.compression_field()


def test_a_name_defined_twice_or_a_shared_option_redefined_is_a_clash():
    two = {"a": _policy("a", _Window), "b": _policy("b", _OtherWindow)}
    assert clashes(two) == [("--window is defined by both a and b: give one a distinct name, or "
                             "make it one shared option (kvsim.policies.options.SHARED)")]
    own = {"a": _policy("a", _OwnCompression), "b": _policy("b", _SharedCompression)}
    assert clashes(own) == [("--compression of a is not the shared definition: declare it with "
                             "kvsim.policies.options.shared")]
    with pytest.raises(RuntimeError, match="--window is defined by both"):
        _groups(two)
    # one definition used by two policies (one Params class, or a subclass) is no clash
    assert clashes({"a": _policy("a", _Window), "b": _policy("b", _Window)}) == []


def test_help_shows_each_option_under_the_policies_that_take_it():
    policies = load_all()
    takers = _takers(policies)
    groups = _groups()
    shown = {f for g in groups.values() for f in g}
    assert shown == {flag(n) for n in takers} and FLAGS <= shown
    assert sum(len(g) for g in groups.values()) == len(shown)  # each flag once
    for title, flags in groups.items():
        for fl, text in flags.items():
            by_policy = takers[fl[2:].replace("-", "_")]
            f = next(iter(by_policy.values()))
            assert text.startswith(f.metadata["help"] + " ["), fl
            if title == "shared policy options":  # names every policy that takes it
                assert len({policies[p].Params for p in by_policy}) > 1, fl
                named = {p for part in text.rsplit("[", 1)[1].split(";")
                         for p in part.split(":")[0].split(", ")}
                assert {p.strip() for p in named} == set(by_policy), fl
            else:  # shown only under exactly the policies that take it
                assert title == f"{', '.join(sorted(by_policy))} options", fl
    assert groups["poissoncomp, topk options"] == {}  # listed, taking only shared options


def test_made_up_policies_get_their_own_groups_and_a_shared_one():
    groups = _groups({"a": _policy("a", _Window), "b": _policy("b", _SharedCompression),
                      "c": _policy("c", _OnlyCompression)}, lists=True)
    assert set(groups) == {"shared policy options", "a options", "b options", "c options"}
    assert groups["shared policy options"]["--compression"].endswith(
        "[b: default 4.0; c: default 16.0]")
    assert set(groups["a options"]) == {"--window"} and set(groups["b options"]) == {"--pages"}
    assert groups["c options"] == {}


@pytest.mark.parametrize("name,bad", [("compression", 0.99), ("compression", float("inf")),
                                      ("eps", 0.0), ("delta", 1.0), ("scorer", "h2o"),
                                      ("sink", -1), ("local", 1.5)])
def test_a_shared_option_has_one_check_for_every_policy(name, bad):
    takers = _takers(load_all())[name]
    messages = set()
    for policy in takers:
        with pytest.raises(KvsimError) as e:
            make(policy, {name: bad})
        messages.add(str(e.value))
    assert len(messages) == 1 and messages.pop().startswith(f"--{name} must"), messages


def test_declared_choices_are_checked_for_every_policy():
    with pytest.raises(KvsimError, match="--quant-axis must be one of channel, token; got 'row'"):
        make("varrate", {"quant_axis": "row"})
    with pytest.raises(KvsimError, match="--coef-bits must be one of 16, 8, 4, 3; got 5"):
        make("flat", {"coef_bits": 5})


def test_compression_one_keeps_the_whole_budget_in_every_policy():
    """1 is the boundary every policy takes: the budget is the whole cache. The eviction
    policies then keep every token (no error); the others run."""
    from kvsim.measure import harness
    from kvsim.model.synthetic import synthetic_attention_trace
    trace = synthetic_attention_trace(n_layers=1, n_q=4, n_kv=2, d=32, context=256, question=8,
                                      decode=2, seed=0)
    fit = {"sink": 4, "local": 4, "r_min": 2, "window": 16, "obs_window": 16}
    takers = _takers(load_all())
    for policy in takers["compression"]:
        taken = {n for n, by in takers.items() if policy in by}
        pol = make(policy, {**{k: v for k, v in fit.items() if k in taken}, "compression": 1})
        a = harness.analyze(pol, trace, seed=0)
        assert a.stats["resident_frac"] == pytest.approx(1.0), policy
        if policy in ("topk", "poissoncomp"):
            assert a.stats["output_rel_err_mean"] < 1e-6, policy
