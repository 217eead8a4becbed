"""Where sweep tasks run: a local process pool (default) or a Ray cluster; same results either way.

An executor maps a picklable function over tasks and yields ``(task, result)`` as each finishes,
and ``HEARTBEAT`` when ``PROGRESS_EVERY_S`` pass with none finishing (so that progress is told on
time however long a task runs). Tasks are taken from their iterable as workers free up, never
ahead of need: a task made after a result came back can depend on it (the deployment search
bounds what is left to search by the fleets found so far).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator

from kvsim.errors import KvsimError
from kvsim.plan.outputs import LOST

PROGRESS_EVERY_S = 30.0  # a plain progress line this often when stderr is not a terminal
HEARTBEAT = (None, None)  # what map yields when no task finished in PROGRESS_EVERY_S


class LocalExecutor:
    name = "local"

    def __init__(self, jobs: int | None = None):
        self.jobs = max(1, jobs or os.cpu_count() or 1)

    def map(self, fn: Callable, tasks: Iterable) -> Iterator[tuple[object, object]]:
        tasks = iter(tasks)
        if self.jobs == 1:  # in this process (a thread, to tell progress)
            with cf.ThreadPoolExecutor(1) as pool:
                for t in tasks:
                    fut = pool.submit(fn, t)
                    while not cf.wait([fut], timeout=PROGRESS_EVERY_S or None).done:
                        yield HEARTBEAT
                    yield t, fut.result()
            return
        import multiprocessing as mp

        from kvsim.plan.reaper import Reaper
        ctx = mp.get_context("spawn")  # fork is unsafe once torch has started threads
        reaper = Reaper()  # the workers die with this process, even by kill -9
        with contextlib.closing(reaper), cf.ProcessPoolExecutor(self.jobs, mp_context=ctx) \
                as pool:
            futures: dict = {}

            def fill():  # one task per free worker, taken when it frees
                while len(futures) < self.jobs:
                    t = next(tasks, _END)
                    if t is _END:
                        return
                    futures[pool.submit(fn, t)] = t
            try:
                fill()
                while futures:
                    done, _ = cf.wait(futures, timeout=PROGRESS_EVERY_S or None,
                                      return_when=cf.FIRST_COMPLETED)
                    if not done:
                        yield HEARTBEAT
                    for fut in done:
                        yield futures.pop(fut), fut.result()
                    fill()
            except cf.process.BrokenProcessPool:
                raise KvsimError(f"a worker process died (killed, or out of memory); "
                                 f"{LOST}") from None


class RayExecutor:
    name = "ray"

    def __init__(self, jobs: int | None = None, address: str | None = None):
        try:
            import ray
        except ImportError:
            raise KvsimError("--executor ray needs Ray: pip install 'kvsim[ray]'") from None
        self.ray = ray
        self.jobs = max(1, jobs or os.cpu_count() or 1)  # tasks in flight at once
        self.reaper = None
        if not ray.is_initialized():
            if address:
                _answers(address)
            kw = {"address": address} if address else {"num_cpus": jobs or os.cpu_count()}
            if not address:  # kvsim starts Ray: its processes die with this one
                from kvsim.plan.reaper import Reaper
                self.reaper = Reaper()
            try:
                ray.init(include_dashboard=False, log_to_driver=False,
                         ignore_reinit_error=True, **kw)
            except Exception as e:  # Ray's own start-up failures, in one line
                first = (str(e).strip().splitlines() or [""])[0][:200]
                raise KvsimError(f"Ray did not start ({type(e).__name__}: {first})") from None

    def map(self, fn: Callable, tasks: Iterable) -> Iterator[tuple[object, object]]:
        remote, tasks = self.ray.remote(_apply), iter(tasks)
        refs: dict = {}
        E = self.ray.exceptions

        def fill():
            while len(refs) < getattr(self, "jobs", 1):
                t = next(tasks, _END)
                if t is _END:
                    return
                refs[remote.remote(fn, t)] = t
        fill()
        while refs:
            done, _ = self.ray.wait(list(refs), num_returns=1,
                                    timeout=PROGRESS_EVERY_S or None)
            if not done:
                yield HEARTBEAT
                continue
            try:
                result = self.ray.get(done[0])
            except (E.WorkerCrashedError, E.NodeDiedError, E.ObjectLostError,
                    E.OwnerDiedError, E.LocalRayletDiedError, E.RaySystemError) as e:
                raise KvsimError(f"a Ray worker was lost ({type(e).__name__}); {LOST}") \
                    from None
            yield refs.pop(done[0]), result
            fill()


RAY_CONNECT_S = 10.0  # how long a Ray address may take to answer before it is refused


def _answers(address: str) -> None:
    """Refuse, in one line and within :data:`RAY_CONNECT_S`, a Ray address (``RAY_ADDRESS``)
    where nothing listens (Ray itself retries for minutes, saying nothing). ``auto`` and
    ``local`` are Ray's own words, left to it (it answers at once)."""
    import socket
    text = address.strip()
    if text in ("auto", "local"):
        return
    host, sep, port = text.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise KvsimError(f"RAY_ADDRESS={address!r}: give HOST:PORT (a Ray head's GCS "
                         f"address, e.g. 10.0.0.5:6379), ray://HOST:PORT or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=RAY_CONNECT_S).close()
    except OSError as e:
        why = f"no answer within {RAY_CONNECT_S:g} s" if isinstance(e, TimeoutError) else \
            (e.strerror or str(e))
        raise KvsimError(f"RAY_ADDRESS={address}: no Ray cluster answers there ({why}); "
                         f"start one (ray start --head) or unset RAY_ADDRESS to run Ray on "
                         f"this machine") from None


def make_executor(name: str, jobs: int | None = None) -> LocalExecutor | RayExecutor:
    if jobs is not None and jobs < 1:
        raise KvsimError(f"--jobs must be positive, got {jobs}")
    if name == "local":
        return LocalExecutor(jobs)
    if name == "ray":
        return RayExecutor(jobs, address=os.environ.get("RAY_ADDRESS"))
    raise KvsimError(f"unknown executor {name!r}; use local or ray")


def run_all(executor, fn: Callable, tasks: Iterable, progress: bool = True,
            desc: str = "runs", on_result: Callable | None = None,
            status: Callable[[], str] | None = None, total: int | None = None) -> list:
    """All results, in task order, with progress on stderr (a bar on a terminal, else a plain
    line every ``PROGRESS_EVERY_S``: tasks done, time so far and left, and ``status()``, e.g.
    the best answer so far); ``on_result(result)`` as each task finishes (the planner's
    journal). ``tasks`` may be a generator, read as workers free up (``total``: how many it
    makes at most, for the progress)."""
    if total is None:
        tasks = list(tasks)
        total = len(tasks)
    results: dict[int, object] = {}
    from tqdm import tqdm
    plain = progress and not sys.stderr.isatty()
    start = last = time.monotonic()
    with tqdm(total=total, desc=desc, disable=None if progress else True,  # a terminal
              unit="task") as bar:
        for item, res in executor.map(_Indexed(fn), enumerate(tasks)):
            if item is not None:
                results[item[0]] = res
                if on_result is not None:
                    on_result(res)
                bar.update(1)
            now = time.monotonic()
            if plain and now - last >= PROGRESS_EVERY_S:
                last = now
                print(_progress(desc, len(results), total, now - start, status),
                      file=sys.stderr, flush=True)
    return [results[i] for i in sorted(results)]


def _progress(desc: str, done: int, total: int, seconds: float, status) -> str:
    left = f"about {seconds / done * (total - done):.0f} s left" if done else "time left unknown"
    more = status() if status is not None else ""
    return (f"kvsim {desc}: {done}/{total} tasks done, {seconds:.0f} s, {left}"
            + (f"; {more}" if more else ""))


_END = object()


def _apply(fn: Callable, task):
    return fn(task)


class _Indexed:
    """Carries a task's index through an executor (picklable, unlike a lambda)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, item):
        return self.fn(item[1])
