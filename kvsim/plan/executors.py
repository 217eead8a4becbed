"""Where sweep tasks run: a local process pool (default) or a Ray cluster; same results either way.

An executor maps a picklable function over tasks and yields ``(task, result)`` as each finishes.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator

from kvsim.errors import KvsimError
from kvsim.plan.outputs import LOST


class LocalExecutor:
    name = "local"

    def __init__(self, jobs: int | None = None):
        self.jobs = max(1, jobs or os.cpu_count() or 1)

    def map(self, fn: Callable, tasks: list) -> Iterator[tuple[object, object]]:
        if self.jobs == 1 or len(tasks) <= 1:
            for t in tasks:
                yield t, fn(t)
            return
        import multiprocessing as mp
        ctx = mp.get_context("spawn")  # fork is unsafe once torch has started threads
        with cf.ProcessPoolExecutor(self.jobs, mp_context=ctx) as pool:
            futures = {pool.submit(fn, t): t for t in tasks}
            try:
                for fut in cf.as_completed(futures):
                    yield futures[fut], fut.result()
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
        if not ray.is_initialized():
            kw = {"address": address} if address else {"num_cpus": jobs or os.cpu_count()}
            ray.init(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                     **kw)

    def map(self, fn: Callable, tasks: list) -> Iterator[tuple[object, object]]:
        remote = self.ray.remote(_apply)
        refs = {remote.remote(fn, t): t for t in tasks}
        pending = list(refs)
        E = self.ray.exceptions
        while pending:
            done, pending = self.ray.wait(pending, num_returns=1)
            try:
                result = self.ray.get(done[0])
            except (E.WorkerCrashedError, E.NodeDiedError, E.ObjectLostError,
                    E.OwnerDiedError, E.LocalRayletDiedError, E.RaySystemError) as e:
                raise KvsimError(f"a Ray worker was lost ({type(e).__name__}); {LOST}") \
                    from None
            yield refs[done[0]], result


def make_executor(name: str, jobs: int | None = None) -> LocalExecutor | RayExecutor:
    if jobs is not None and jobs < 1:
        raise KvsimError(f"--jobs must be positive, got {jobs}")
    if name == "local":
        return LocalExecutor(jobs)
    if name == "ray":
        return RayExecutor(jobs, address=os.environ.get("RAY_ADDRESS"))
    raise KvsimError(f"unknown executor {name!r}; use local or ray")


PROGRESS_EVERY_S = 30.0  # a plain progress line this often when stderr is not a terminal


def run_all(executor, fn: Callable, tasks: Iterable, progress: bool = True,
            desc: str = "runs", on_result: Callable | None = None) -> list:
    """All results, in task order, with progress on stderr (a bar on a terminal, else a plain
    line every ``PROGRESS_EVERY_S``); ``on_result(result)`` as each task finishes (the
    planner's journal)."""
    tasks = list(tasks)
    results: dict[int, object] = {}
    indexed = list(enumerate(tasks))
    from tqdm import tqdm
    plain = progress and not sys.stderr.isatty()
    start = last = time.monotonic()
    with tqdm(total=len(tasks), desc=desc, disable=None if progress else True,  # a terminal
              unit="task") as bar:
        for (i, _), res in executor.map(_Indexed(fn), indexed):
            results[i] = res
            if on_result is not None:
                on_result(res)
            bar.update(1)
            now = time.monotonic()
            if plain and now - last >= PROGRESS_EVERY_S:
                last = now
                print(f"kvsim {desc}: {len(results)}/{len(tasks)} tasks done, "
                      f"{now - start:.0f} s", file=sys.stderr, flush=True)
    return [results[i] for i in range(len(tasks))]


def _apply(fn: Callable, task):
    return fn(task)


class _Indexed:
    """Carries a task's index through an executor (picklable, unlike a lambda)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, item):
        return self.fn(item[1])
