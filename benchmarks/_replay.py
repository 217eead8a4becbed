"""A replay named by keyword arguments (configure's names), on this checkout's kvsim or on an
older one (``PYTHONPATH=OTHER_CHECKOUT``, where a replay took a flat ``ReplayConfig``), so that a
benchmark times the same work on both."""

from __future__ import annotations

import kvsim.replay as replay

RUN_OPTIONS = ("jobs", "timeline", "timeline_steps", "force")


def prepared(**kw):
    """What :func:`run` takes: the configuration ``kw`` names (its checks done here, once)."""
    if hasattr(replay, "configure"):
        run_options = {k: kw.pop(k) for k in RUN_OPTIONS if k in kw}
        return replay.configure(**kw), run_options
    fields = replay.ReplayConfig.__dataclass_fields__  # older checkouts
    return replay.ReplayConfig(**{k: v for k, v in kw.items() if k in fields}), {}


def run(prepared_config) -> dict:
    """The replay's JSON report."""
    cfg, run_options = prepared_config
    r = replay.run_replay(cfg, **run_options)
    return r.to_json() if hasattr(r, "to_json") else r
