"""Child processes die with their parent: a sweep's worker processes (the local pool's, and Ray's
when kvsim started Ray) are handed to a small watcher process, which kills them and everything
they started when the plan's process ends, however it ends (``kill -9`` included: the watcher
learns it from its input pipe closing, which no signal can keep open).

The watcher is ``python -m kvsim.plan.reaper PARENT``; it imports no other kvsim module. Every
:data:`POLL_S` it notes the descendants of the plan's process that were not there when it was
made (a pool's workers; Ray's GCS, raylet, and the agents and workers the raylet starts later),
each with its start time in clock ticks since boot from ``/proc``, so that a PID the system
reused is never killed. Linux only (``/proc``); elsewhere :class:`Reaper` does nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

PROC = Path("/proc")
POLL_S = 0.5  # how often the watcher looks for the plan's new processes


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent PID, start time) of a live process; None if it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return int(fields[1]), int(fields[19])


def descendants(*roots: int) -> dict[int, int]:
    """Every live descendant of the ``roots``: PID -> start time."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            got = _stat(int(entry.name))
            if got is not None:
                children.setdefault(got[0], []).append(int(entry.name))
                starts[int(entry.name)] = got[1]
    out, todo = {}, list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            out[child] = starts[child]
            todo.append(child)
    return out


class Reaper:
    """The watcher of the processes this one starts from now on (not those already there:
    another executor's): it finds them and their descendants every :data:`POLL_S` while this
    process lives, and kills them if this process ends before :meth:`close`."""

    def __init__(self):
        self.proc = None
        if not PROC.is_dir():
            return
        before = descendants(os.getpid())
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvsim.plan.reaper", str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        except OSError:  # no interpreter to start (embedded Python): run without a watcher
            return
        try:
            self.proc.stdin.write(" ".join(map(str, before)).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # the watcher is gone: nothing more to do than without it
            pass

    def close(self) -> None:
        """This process lives on and has ended what it started (a pool shut down): the watcher
        leaves without killing (a process it noted that lives on, such as multiprocessing's
        resource tracker, is this process's to keep)."""
        if self.proc is not None:
            try:
                self.proc.stdin.write(b"done\n")
                self.proc.stdin.close()
            except OSError:
                pass
            self.proc.wait()
            self.proc = None


def _main(parent: int) -> None:
    """The watcher of ``parent``: read the PIDs it had before (one line), then until the input
    closes, every :data:`POLL_S`, note its other descendants (PID and start time) and the Ray
    session directories they name; then kill each of those that is still the process it was,
    with whatever they started and whatever works in those sessions."""
    import select
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the terminal is the plan's
    stdin = sys.stdin.buffer.raw
    # never the parent itself (it may hold files in a Ray session: a driver; at its normal exit
    # it is still alive when its pipe closes), nor what it had before, nor this watcher
    skip = {int(p) for p in stdin.readline().split()} | {os.getpid(), parent}
    known: dict[int, int] = {}
    sessions: set[bytes] = set()
    while True:
        new = {p: s for p, s in descendants(parent, *_live(known)).items()
               if p not in skip and p not in known}
        known |= new
        sessions |= _ray_sessions(new)
        if select.select([stdin], [], [], POLL_S)[0]:
            got = os.read(stdin.fileno(), 65536)
            if got.startswith(b"done"):  # the parent lives on: nothing to kill
                return
            if not got:
                break
    # the parent is gone: stop them all (none starts another after that), and what they
    # started since, until no new one appears; then kill them. Ray's GCS and raylet die with
    # the plan (Ray ties them to it): a worker the raylet was starting is then init's child,
    # found by its session
    stopped: dict[int, int] = {}
    while todo := {p: s for p, s in (known | descendants(*_live(known)) | _in_sessions(sessions))
                   .items() if p not in stopped and p not in skip}:
        for pid, start in todo.items():
            _signal(pid, start, signal.SIGSTOP)
        stopped |= todo
        known |= todo
    for pid, start in stopped.items():
        _signal(pid, start, signal.SIGKILL)


def _live(known: dict[int, int]) -> list[int]:
    """The PIDs of ``known`` that are still the processes noted (a reused PID's children are
    not ours)."""
    return [p for p, s in known.items() if (_stat(p) or (0, None))[1] == s]


def _ray_sessions(pids) -> set[bytes]:
    """The Ray session directories these processes name (a GCS's or raylet's
    ``--session-dir=``)."""
    out = set()
    for pid in pids:
        try:
            args = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        out |= {a.split(b"=", 1)[1] for a in args if a.startswith(b"--session-dir=")}
    return out


def _in_sessions(sessions: set[bytes]) -> dict[int, int]:
    """The processes whose command line names one of these Ray session directories, or that
    hold a file in one: Ray's workers and agents."""
    if not sessions:
        return {}
    out = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "cmdline").read_bytes()
            held = [os.readlink(fd).encode() for fd in (entry / "fd").iterdir()]
        except OSError:
            continue
        if any(s in text for s in sessions) or any(h.startswith(s) for h in held
                                                   for s in sessions):
            got = _stat(int(entry.name))
            if got is not None:
                out[int(entry.name)] = got[1]
    return out


def _signal(pid: int, start: int, sig: int) -> None:
    """Send ``sig`` to ``pid`` if it is still the process that started at ``start``."""
    got = _stat(pid)
    if got is not None and got[1] == start:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


if __name__ == "__main__":
    _main(int(sys.argv[1]))
