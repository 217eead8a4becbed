"""Policy specs: the one place that turns what a user wrote into validated policy options.

One syntax everywhere (``kvsim replay``, ``plan``, ``eval``, ``policy-profile``):
``NAME[:KEY=VALUE...]`` items, comma-separated where a command takes several
(``dense,verkv:sketch=perfect:eps=0.05``); a policy's own options are written in its item. The
options every policy shares (:data:`~kvsim.policies.options.SHARED`) are also flags
(``--eps 0.05``) that go to every named policy that takes them; options written in an item
override the flags. Two policies may each have an option of the same name with its own
meaning; a shared option has one. Values are converted to the type of the option's default and
the whole ``Params`` is validated here, before any work starts.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from kvsim.errors import KvsimError
from kvsim.policies.options import SHARED, check_common
from kvsim.policies.registry import resolve

TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


@dataclass(frozen=True)
class PolicySpec:
    name: str  # the registered name
    options: dict = field(default_factory=dict)  # the options given (typed, validated)
    label: str = ""  # how results are named: the item as written, or the name

    def __post_init__(self):
        if not self.label:
            object.__setattr__(self, "label", self.name)


def fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls.Params)}


def kind(f: dataclasses.Field) -> type:
    """The type an option's values take: ``metadata["kind"]``, else that of its default (str
    when it has none)."""
    if "kind" in f.metadata:
        return f.metadata["kind"]
    return type(f.default) if f.default not in (dataclasses.MISSING, None) else str


def clashes(policies: dict[str, type]) -> list[str]:
    """Every shared option (:data:`~kvsim.policies.options.SHARED`) that one of ``policies``
    declares with a help, kind or choices of its own instead of the shared definition. Other
    option names are each policy's own: two policies may use one name for different things."""
    out = []
    for name, cls in sorted(policies.items()):
        for f in dataclasses.fields(cls.Params):
            s = SHARED.get(f.name)
            if s is not None and (f.metadata.get("help"), kind(f),
                                  tuple(f.metadata.get("choices", ()))) != \
                    (s.help, s.kind, s.choices):
                out.append(f"{flag(f.name)} of {name} is not the shared definition: "
                           f"declare it with kvsim.policies.options.shared")
    return out


def convert(kind_: type, text: str):
    """``text`` as a value of ``kind_`` (bools: true/false/1/0/yes/no); ValueError otherwise."""
    text = text.strip()
    if kind_ is bool:
        if text.lower() not in TRUE + FALSE:
            raise ValueError(f"expected true/false, got {text!r}")
        return text.lower() in TRUE
    try:
        return kind_(text)
    except ValueError:
        raise ValueError(f"expected {kind_.__name__}, got {text!r}") from None


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def params(cls, options: dict):
    """``cls.Params(**options)``, validated; an option it does not take is a one-line error."""
    taken = fields(cls)
    foreign = sorted(set(options) - set(taken))
    if foreign:
        accepted = ", ".join(flag(f) for f in sorted(taken)) or "no options"
        raise KvsimError(f"{', '.join(flag(f) for f in foreign)} does not apply to policy "
                         f"{cls.name} (it takes {accepted})")
    p = cls.Params(**options)
    check_common(p)
    if hasattr(p, "validate"):
        p.validate()
    return p


def make(name: str, options: dict | None = None):
    """The policy ``name`` (or an alias) with ``options``, validated."""
    cls = resolve(name)
    return cls(params(cls, dict(options or {})))


def _item(item: str, flags: dict, grid: bool) -> tuple[PolicySpec, set[str]]:
    name, *pairs = [s.strip() for s in item.split(":")]
    cls = resolve(name)
    taken = fields(cls)
    used = set(flags) & set(taken)
    opts = {} if grid else {k: flags[k] for k in used}
    for pair in pairs:
        if "=" not in pair:
            raise KvsimError(f"--policy item {item!r}: options are KEY=VALUE")
        key, text = (s.strip() for s in pair.split("=", 1))
        key = key.replace("-", "_")
        if key not in taken:
            accepted = ", ".join(sorted(taken)) or "none"
            raise KvsimError(f"policy {cls.name} has no option {key!r} (it takes {accepted}; "
                             f"kvsim policies {cls.name} describes them)")
        try:
            opts[key] = convert(kind(taken[key]), text)
        except ValueError as e:
            raise KvsimError(f"{cls.name}:{key}={text}: {e}") from None
    label = item if pairs or cls.name == name else cls.name
    return PolicySpec(cls.name, opts, label), used


def parse(text: str | list[str], flags: dict | None = None,
          grid: bool = False) -> tuple[list[PolicySpec], list[str]]:
    """Specs for the items of ``text`` and the option ``flags`` given, each validated; and the
    flags (as ``--name``) that no named policy takes, for the caller to refuse or report.

    With ``grid`` every flag holds a list of values and each item becomes one spec per
    combination of the values its policy takes (:func:`expand`)."""
    items = text if isinstance(text, list) else text.split(",")
    items = [t.strip() for t in items if t.strip()]
    if not items:
        raise KvsimError("--policy is empty")
    flags = dict(flags or {})
    specs, used = [], set()
    for item in items:
        spec, taken = _item(item, flags, grid)
        params(resolve(spec.name), spec.options)
        specs.append(spec)
        used |= taken
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise KvsimError("--policy lists the same policy twice")
    if grid:
        specs = [e for s in specs for e in expand(s, flags)]
    return specs, [flag(f) for f in sorted(set(flags) - used)]


def expand(spec: PolicySpec, grid: dict[str, list]) -> list[PolicySpec]:
    """Every combination of the ``grid`` values of the options ``spec``'s policy takes (options
    written in the spec stay fixed), each validated."""
    cls = resolve(spec.name)
    names = sorted(n for n in grid if n in fields(cls) and n not in spec.options)
    out = []
    for values in itertools.product(*(grid[n] for n in names)):
        opts = {**dict(zip(names, values)), **spec.options}
        params(cls, opts)
        out.append(PolicySpec(spec.name, opts, spec.label))
    return out
