"""One check per kind of number, whether it came from a flag or from a file: the same number
gets the same test and the same words (``--link-gbps must be finite, got inf``) wherever it was
written. :func:`flag_type` makes an argparse ``type`` of a check; ``kvsim.cli`` gives every
plain ``int`` flag :func:`whole` (>= 0) and every plain ``float`` flag :func:`real` (finite)."""

from __future__ import annotations

import argparse
import math

from kvsim.errors import KvsimError

MAX_WHOLE = 2**63 - 1  # beyond this a count overflows int64 wherever it goes


def parse(text: str):
    """A flag's text as an int or a float; text that is neither stays text (and fails its
    check). A file's values are checked as they were read: ``"32"`` in JSON is not a number."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _number(v, name: str, what: str) -> float:
    if not isinstance(v, bool) and isinstance(v, (int, float)):
        return v
    raise KvsimError(f"{name}must be {what}, got {_shown(v)}")


def _shown(v) -> str:
    text = f"{v:g}" if isinstance(v, float) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _named(name: str) -> str:
    return f"{name} " if name else ""


def whole(v, name: str = "", least: int = 0, most: int = MAX_WHOLE) -> int:
    """``v`` as an int in ``[least, most]`` (a float must be whole: 3.0, not 3.5)."""
    what = f"a whole number >= {least}"
    n = _number(v, _named(name), what)
    if isinstance(n, float) and not (math.isfinite(n) and n.is_integer()) or n < least:
        raise KvsimError(f"{_named(name)}must be {what}, got {_shown(v)}")
    n = int(n)
    if n > most:
        raise KvsimError(f"{_named(name)}{n:,} is beyond what kvsim handles ({most:,})")
    return n


def real(v, name: str = "", least: float | None = None, above: float | None = None,
         most: float | None = None, what: str = "") -> float:
    """``v`` as a finite float, ``>= least``, ``> above``,
    ``<= most`` where given."""
    bounds = [f"{op} {b:g}" for op, b in ((">=", least), (">", above), ("<=", most))
              if b is not None]
    what = what or ("a number " + " and ".join(bounds) if bounds else "a number")
    x = float(_number(v, _named(name), what))
    if not math.isfinite(x):
        raise KvsimError(f"{_named(name)}must be finite, got {_shown(x)}")
    if (least is not None and x < least) or (above is not None and x <= above) or \
            (most is not None and x > most):
        raise KvsimError(f"{_named(name)}must be {what}, got {_shown(x)}")
    return x


def share(v, name: str = "") -> float:
    """A share in [0, 1]."""
    return real(v, name, least=0.0, most=1.0, what="a share in [0, 1]")


def positive(v, name: str = "") -> float:
    """A finite number > 0."""
    return real(v, name, above=0.0, what="positive")


def distinct(values: list, name: str) -> list:
    """``values`` (a list flag's, in order), refusing one given twice: a list is a set."""
    seen = set()
    for v in values:
        if v in seen:
            raise KvsimError(f"{name}: {_shown(v)} is listed twice; give each value once")
        seen.add(v)
    return values


MAX_GIB = float(2**20)  # a memory tier per GPU, or a pool: at most 1 PiB
MIN_GBPS, MAX_GBPS = 0.01, 1e5  # no host, peer or storage link below 10 MB/s or above 100 TB/s


def size_gib(v, name: str = "") -> float:
    """A memory size in GiB: finite, in [0, :data:`MAX_GIB`]."""
    return real(v, name, least=0.0, most=MAX_GIB, what=f"a size in [0, {MAX_GIB:,.0f}] GiB "
                                                        f"(1 PiB)")


def rate_gbps(v, name: str = "") -> float:
    """A link's, disk's or pool's rate in GB/s, in [:data:`MIN_GBPS`, :data:`MAX_GBPS`]."""
    return real(v, name, least=MIN_GBPS, most=MAX_GBPS,
                what=f"a rate in [{MIN_GBPS:g}, {MAX_GBPS:g}] GB/s")


def flag_type(check, **bounds):
    """An argparse ``type`` that converts a flag's text with ``check`` (one line, exit 2)."""
    def convert(text: str):
        try:
            return check(parse(text), **bounds)
        except KvsimError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = check.__name__  # argparse names the type in its messages
    return convert


def checked_flags(parser: argparse.ArgumentParser) -> None:
    """Give every plain ``int`` flag of ``parser`` :func:`whole` (>= 0) and every plain
    ``float`` flag :func:`real` (finite): no flag takes a negative count, NaN or infinity."""
    for action in parser._actions:
        if action.type is int:
            action.type = flag_type(whole)
        elif action.type is float:
            action.type = flag_type(real)
