"""Safe files: reading JSON (:func:`read_json`, every JSON input's one reader), reading a kvsim
``.npz`` (a JSON ``meta`` plus arrays, never pickles), and writing outputs (check the destination
first, write to a temporary name, then rename)."""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

import numpy as np

from kvsim.errors import KvsimError

MAX_NPZ_BYTES = 16 * 2**30  # what a kvsim file may inflate to (a capture set is ~0.2 GiB)
MAX_JSON_BYTES = 256 * 2**20  # a JSON input (the largest, a policy profile, is a few MiB)
MAX_JSON_DEPTH = 32  # nesting of a JSON input (kvsim's own are at most 5 deep)
_TYPES = {dict: "a JSON object", list: "a JSON array", str: "a string", int: "a number",
          float: "a number", bool: "true or false", type(None): "null"}


def regular_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` if it is a regular file (or a link to one); a FIFO, a device, a directory or a
    dangling link is one line, before anything opens it (a FIFO would block the read)."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise KvsimError(f"{p}: no such {what} file") from None
    except OSError as e:  # a symlink loop, a permission problem
        raise KvsimError(f"{p}: cannot read the {what} file ({e.strerror})") from None
    import stat
    if not stat.S_ISREG(st.st_mode):
        kind = "is a directory" if stat.S_ISDIR(st.st_mode) else "is not a regular file"
        raise KvsimError(f"{p}: {kind} (give a {what} file)")
    return p


class _NotFinite(ValueError):
    pass


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise _NotFinite(text)
    return x


def _refuse(text: str):
    raise _NotFinite(text)


def _nan(text: str) -> float:
    return math.nan if text == "NaN" else _refuse(text)


class _Duplicate(ValueError):
    pass


def _unique(pairs: list) -> dict:
    """A JSON object's pairs as a dict, refusing a key given twice (which would silently take
    the last)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        raise _Duplicate(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string (escapes included)


def _scan(text: str) -> tuple[int, bool]:
    """How deep JSON ``text`` nests (its brackets outside strings, counted before it is parsed:
    a hostile file cannot reach the parser's recursion), and whether a number in it may be
    beyond a float (an exponent of 3 digits, or 300 digits in a row)."""
    huge = re.search(r"[eE][+-]?\d{3}", text) is not None
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH and len(text) < 300:  # a short line
        return 0, huge
    b = np.frombuffer(_STRING.sub("", text).encode(), np.uint8)
    step = np.isin(b, (91, 123)).astype(np.int32) - np.isin(b, (93, 125))  # [{ and ]}
    edges = np.flatnonzero(np.diff(((b >= 48) & (b <= 57)).astype(np.int8), prepend=0,
                                   append=0))
    longest = int((edges[1::2] - edges[::2]).max(initial=0))
    return int(np.cumsum(step).max(initial=0)), huge or longest >= 300


def loads_json(text: str | bytes, where: str, what: str, top: type | None = dict,
               nan: bool = False):
    """``text`` parsed as JSON, refused in one line naming ``where`` when it is not JSON, holds
    NaN (unless ``nan``: kvsim's own tables, where it means "not measured"), Infinity or a
    number beyond a float, nests deeper than :data:`MAX_JSON_DEPTH`, or is not a ``top``
    (None: any type)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError:
            packed = " (gzip-compressed: decompress it first)" * text.startswith(b"\x1f\x8b")
            raise KvsimError(f"{where}: not UTF-8 text{packed} (a {what} is JSON)") from None
    depth, huge = _scan(text)
    if depth > MAX_JSON_DEPTH:
        raise KvsimError(f"{where}: {what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        obj = json.loads(text, parse_float=_finite if huge else None,
                         parse_constant=_nan if nan else _refuse, object_pairs_hook=_unique)
    except _Duplicate as e:
        raise KvsimError(f"{where}: {what} gives the key {str(e)[:40]!r} twice in one object; "
                         f"give each key once") from None
    except _NotFinite as e:
        shown = str(e) if len(str(e)) <= 40 else str(e)[:37] + "..."
        raise KvsimError(f"{where}: {what} holds {shown}; every number must be finite") \
            from None
    except RecursionError:
        raise KvsimError(f"{where}: {what} nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, or an integer of more than 4300 digits
        raise KvsimError(f"{where}: not JSON ({getattr(e, 'msg', e)}; a {what} is JSON)") \
            from None
    if top is not None and not isinstance(obj, top):
        raise KvsimError(f"{where}: not {_TYPES[top]} but {_TYPES[type(obj)]} (a {what} is "
                         f"{_TYPES[top]})")
    return obj


def read_json(path: str | os.PathLike, what: str, top: type | None = dict,
              max_bytes: int = MAX_JSON_BYTES):
    """The JSON file ``path`` (a ``what``), checked as :func:`loads_json` does, after the file
    itself (:func:`read_bytes`)."""
    return loads_json(read_bytes(path, what, max_bytes), str(path), what, top)


def read_bytes(path: str | os.PathLike, what: str, max_bytes: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of ``path`` (a ``what``): a regular file (:func:`regular_file`) of at most
    ``max_bytes``."""
    p = regular_file(path, what)
    try:
        size = p.stat().st_size
        if size > max_bytes:
            raise KvsimError(f"{p}: {size / 2**20:.3g} MiB, beyond what kvsim reads as a {what} "
                             f"({max_bytes / 2**20:g} MiB)")
        return p.read_bytes()
    except OSError as e:
        raise KvsimError(f"{p}: cannot read the {what} file ({e.strerror or e})") from None


def _check_members(z: zipfile.ZipFile, where: str, what: str) -> None:
    """Refuse before inflating: members that are not ``.npy``, or that inflate (or declare
    arrays) beyond :data:`MAX_NPZ_BYTES`."""
    total = 0
    for info in z.infolist():
        if not info.filename.endswith(".npy"):
            raise KvsimError(f"{where}: not a kvsim {what} (member {info.filename!r} is not an "
                             f".npy array)")
        total += info.file_size
        with z.open(info) as f:
            try:
                version = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, _, dtype = read(f, max_header_size=1 << 16)
            except (ValueError, OSError, EOFError) as e:
                raise KvsimError(f"{where}: member {info.filename!r} is not a readable .npy "
                                 f"array ({e})") from None
        declared = int(np.prod(shape, dtype=np.float64)) * dtype.itemsize if dtype.itemsize \
            else 0
        if declared > MAX_NPZ_BYTES or total > MAX_NPZ_BYTES:
            raise KvsimError(f"{where}: member {info.filename!r} declares "
                             f"{max(declared, total) / 2**30:.3g} GiB, beyond what kvsim reads "
                             f"({MAX_NPZ_BYTES / 2**30:g} GiB)")


def read_npz(path: str | os.PathLike, what: str, fmt: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays) of a kvsim ``.npz`` whose JSON ``meta`` has ``format == fmt``; every
    problem is one :class:`KvsimError` line naming the file and ``what`` it should be."""
    where = str(path)
    regular_file(path, what)
    try:
        with zipfile.ZipFile(path) as zf:
            _check_members(zf, where, what)
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise KvsimError(f"{where}: not a readable .npz {what} ({type(e).__name__}: {e})") \
            from None
    if "meta" not in arrays:
        raise KvsimError(f"{where}: not a kvsim {what} (no 'meta' entry)")
    meta = loads_json(str(arrays.pop("meta")), f"{where}: meta", what, top=None, nan=True)
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        raise KvsimError(f"{where}: not a kvsim {what} (meta.format != {fmt!r})")
    return meta, arrays


def check_destination(path: str | os.PathLike, force: bool = False) -> Path:
    """Raise a one-line :class:`KvsimError` unless ``path`` may be written."""
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not force:  # a dangling link counts too
        raise KvsimError(f"{path} exists; pass --force to overwrite it")
    if path.is_dir():
        raise KvsimError(f"{path} is a directory")
    parent = path.parent
    if not parent.is_dir():
        raise KvsimError(f"{path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise KvsimError(f"{path}: directory {parent} is not writable")
    try:  # permission bits do not tell everything (read-only mounts, root)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=parent)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise KvsimError(f"{path}: cannot write in {parent} ({e.strerror})") from None
    return path


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None],
                 force: bool = False) -> Path:
    """Write ``path`` through ``write(file)`` into a temporary file, fsync it, rename it into
    place and fsync the directory; a full disk or a permission problem is one line."""
    path = check_destination(path, force)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise KvsimError(f"{path}: cannot write ({e.strerror})") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise KvsimError(f"{path}: cannot write ({e.strerror or e})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the platform allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def finite_json(x, at: str = ""):
    """``x`` as plain JSON values: NaN (not measured) as null; an infinite number is an error
    naming where it is (a result holding one is no answer; JSON has no infinity)."""
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        if math.isnan(x):
            return None
        raise KvsimError(f"the result's {at.lstrip('.') or 'value'} is {x:g}: an input is "
                         f"beyond what kvsim models (no result written)")
    if isinstance(x, dict):
        return {str(k): finite_json(v, f"{at}.{k}") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_json(v, f"{at}[{i}]") for i, v in enumerate(x)]
    if hasattr(x, "tolist"):
        return finite_json(x.tolist(), at)
    return x
