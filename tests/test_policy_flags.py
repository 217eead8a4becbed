"""Policy options on a command line: a policy's own options live in its spec
(``--policy quest:token_budget=2048``); the shared ones (compression, eps, delta, scorer, sink,
local) are also flags, documented in every command's help, with one check for every policy. A
policy-specific option given as a flag is refused in one line naming the spec form. Two policies
may use one option name for different things; a shared option has one definition."""

import dataclasses
from dataclasses import dataclass, field

import pytest
from conftest import run_cli

from kvsim.cli import build_parser
from kvsim.errors import KvsimError
from kvsim.policies import REGISTRY, load_all, make, parse
from kvsim.policies import options as O
from kvsim.policies.spec import clashes, flag

SHARED_FLAGS = {flag(n) for n in O.SHARED}
# the policy-specific flags kvsim shipped before they moved into the spec (flag -> a policy that
# takes it): each is refused, naming the spec form
MOVED = {"--sketch": "verkv", "--shrinkage": "verkv", "--shortlist": "verkv",
         "--pass-plan": "verkv", "--eps-output": "verkv", "--variant": "verkv",
         "--coef-bits": "varrate", "--group-size": "varrate", "--quant-axis": "flat",
         "--basis": "varrate", "--setting": "flat", "--mode": "varrate", "--r-min": "varrate",
         "--rank-cap": "varrate", "--stride": "varrate", "--anchors-c": "varrate",
         "--window": "varrate", "--obs-window": "flat", "--page-size": "quest",
         "--token-budget": "quest"}


def _policy(name: str, params: type) -> type:
    return type(name, (), {"name": name, "Params": params, "summary": ""})


def _takers(policies: dict) -> dict[str, dict[str, dataclasses.Field]]:
    """{option: {policy: its field}}."""
    out: dict[str, dict] = {}
    for name, cls in policies.items():
        for f in dataclasses.fields(cls.Params):
            out.setdefault(f.name, {})[name] = f
    return out


def _shared_group(command: str) -> set[str]:
    sub = build_parser([command])._subparsers._group_actions[0].choices[command]
    (group,) = [g for g in sub._action_groups if g.title == "shared policy options"]
    return {a.option_strings[0] for a in group._group_actions}


def test_registered_policies_declare_each_shared_option_with_its_one_definition():
    assert clashes(load_all()) == []


@dataclass
class _Window:
    window: int = field(default=64, metadata={"help": "recent tokens kept"})


@dataclass
class _OtherWindow:
    window: str = field(default="hann", metadata={"help": "a taper", "choices": ("hann", "flat")})


@dataclass
class _OwnCompression:
    compression: float = field(default=8.0, metadata={"help": "cache is this much smaller"})


def test_two_policies_may_give_one_option_name_two_meanings(monkeypatch):
    """No clash rule for a policy's own options: each spec reads its policy's definition."""
    monkeypatch.setitem(REGISTRY, "a-win", _policy("a-win", _Window))
    monkeypatch.setitem(REGISTRY, "b-win", _policy("b-win", _OtherWindow))
    assert clashes({"a": REGISTRY["a-win"], "b": REGISTRY["b-win"]}) == []
    specs, unused = parse("a-win:window=32,b-win:window=flat")
    assert [s.options for s in specs] == [{"window": 32}, {"window": "flat"}] and unused == []
    with pytest.raises(KvsimError, match="a-win:window=flat: expected int"):
        parse("a-win:window=flat")
    with pytest.raises(KvsimError, match="--window must be one of hann, flat; got 'tri'"):
        parse("b-win:window=tri")


def test_a_shared_option_redefined_by_a_policy_is_a_clash():
    own = {"a": _policy("a", _OwnCompression)}
    assert clashes(own) == [("--compression of a is not the shared definition: declare it with "
                             "kvsim.policies.options.shared")]


@pytest.mark.parametrize("command", ["replay", "plan", "eval", "policy-profile"])
def test_only_the_shared_options_are_flags_and_each_is_documented(command):
    assert _shared_group(command) == SHARED_FLAGS
    sub = build_parser([command])._subparsers._group_actions[0].choices[command]
    text = sub.format_help()
    assert all(f in text for f in SHARED_FLAGS)
    assert not set(MOVED) & set(sub._option_string_actions)
    assert "kvsim policies" in text  # where each policy's own options are listed


def test_every_option_of_a_registered_policy_not_shared_is_refused_as_a_flag():
    from kvsim.commands._policy_flags import moved_flag
    sub = build_parser(["replay"])._subparsers._group_actions[0].choices["replay"]
    known = sub._option_string_actions
    own = {(p, n) for n, by in _takers(load_all()).items() if n not in O.SHARED for p in by}
    assert {flag(n) for _, n in own} >= set(MOVED)
    for policy, name in sorted(own):
        said = moved_flag(["--policy", policy, flag(name), "7"], known)
        assert said.startswith(f"{flag(name)} is an option of ") and policy in said.split(":")[0]
        assert f"write --policy {policy}:{name}=7; kvsim policies {policy} lists" in said


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_policy_specific_flag_is_refused_naming_its_spec(old):
    owner = MOVED[old]
    code, out, err = run_cli("replay", "--policy", owner, old, "7")
    assert code == 2 and out == ""
    key = old[2:].replace("-", "_")
    (line,) = err.strip().splitlines()
    assert line.startswith(f"kvsim replay: error: {old} is an option of ")
    assert line.endswith(f": write --policy {owner}:{key}=7; kvsim policies {owner} lists its "
                         f"options")


def test_the_refusal_names_the_policy_given_and_every_value():
    code, _, err = run_cli("replay", "--policy", "varrate:compression=4", "--window=32")
    assert code == 2 and "write --policy varrate:compression=4:window=32;" in err
    code, _, err = run_cli("plan", "--gpu", "h100-sxm", "--model", "qwen3-4b", "--context",
                           "4096", "--policy", "dense-offload,verkv", "--sketch", "2bit,perfect",
                           "--out", "unused")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "write --policy verkv:sketch=2bit,verkv:sketch=perfect;" in err
    code, _, err = run_cli("eval", "--policy", "quest", "--token-budget", "2048")
    assert code == 2 and "write --policy quest:token_budget=2048;" in err
    # an abbreviation argparse would take for another flag (--mode for --model) is refused too
    code, _, err = run_cli("replay", "--mode", "fused")
    assert code == 2 and "--mode is an option of " in err and ":mode=fused;" in err


def test_the_spec_form_sets_and_sweeps_a_policy_specific_option():
    specs, _ = parse("verkv:sketch=2bit,verkv:sketch=perfect", {"eps": [0.05, 0.1]}, grid=True)
    assert sorted((s.label, s.options["sketch"], s.options["eps"]) for s in specs) == [
        ("verkv:sketch=2bit", "2bit", 0.05), ("verkv:sketch=2bit", "2bit", 0.1),
        ("verkv:sketch=perfect", "perfect", 0.05), ("verkv:sketch=perfect", "perfect", 0.1)]
    specs, unused = parse("quest:token_budget=2048", {"sink": 4, "eps": 0.1})
    assert specs[0].options == {"token_budget": 2048, "sink": 4} and unused == ["--eps"]


def test_unknown_key_in_a_spec_points_to_kvsim_policies():
    with pytest.raises(KvsimError, match="policy quest has no option 'sketch' .*kvsim policies "
                                         "quest describes them"):
        parse("quest:sketch=perfect")


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
