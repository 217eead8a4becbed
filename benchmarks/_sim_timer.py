"""``Simulator.run``'s own CPU time, for the benchmarks that time the simulator beside a whole
replay."""

from __future__ import annotations

import contextlib
import time

import kvsim.sim.engine as engine


@contextlib.contextmanager
def simulator_seconds():
    """Within the block every ``Simulator.run`` appends its CPU seconds to the list yielded."""
    seconds, run = [], engine.Simulator.run

    def timed(self, *a, **k):
        t = time.process_time()
        out = run(self, *a, **k)
        seconds.append(time.process_time() - t)
        return out

    engine.Simulator.run = timed
    try:
        yield seconds
    finally:
        engine.Simulator.run = run
