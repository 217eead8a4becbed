"""Safe files: reading a kvsim ``.npz`` (a JSON ``meta`` plus arrays, never pickles), and writing
outputs (check the destination first, write to a temporary name, then rename)."""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import IO, Callable

import numpy as np

from kvsim.errors import KvsimError


def read_npz(path: str | os.PathLike, what: str, fmt: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays) of a kvsim ``.npz`` whose JSON ``meta`` has ``format == fmt``; every
    problem is one :class:`KvsimError` line naming the file and ``what`` it should be."""
    where = str(path)
    if not Path(path).exists():
        raise KvsimError(f"{where}: no such {what} file")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise KvsimError(f"{where}: not a readable .npz {what} ({type(e).__name__}: {e})") \
            from None
    if "meta" not in arrays:
        raise KvsimError(f"{where}: not a kvsim {what} (no 'meta' entry)")
    try:
        meta = json.loads(str(arrays.pop("meta")))
    except json.JSONDecodeError as e:
        raise KvsimError(f"{where}: meta is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        raise KvsimError(f"{where}: not a kvsim {what} (meta.format != {fmt!r})")
    return meta, arrays


def check_destination(path: str | os.PathLike, force: bool = False) -> Path:
    """Raise a one-line :class:`KvsimError` unless ``path`` may be written."""
    path = Path(path)
    if path.exists() and not force:
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
    """Write ``path`` through ``write(file)`` into a temporary file renamed into place."""
    path = check_destination(path, force)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
