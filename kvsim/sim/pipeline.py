"""The layer pipeline of one decode step: when each layer's transfer and compute start.

Per layer a step costs ``c`` of compute (GEMMs + attention), ``d`` of decide and ``x`` of
transfer over the host link, the same for every layer of one step:

* overlapped (double buffering, two staging buffers): layer l's copy starts when layer l-1's copy
  is done and layer l-2 has freed its buffer; its compute starts when both its copy and layer
  l-1's compute are done. With equal layers this has a closed form::

      copy_start[l]    = 0 (l = 0),  x + (l - 1) * max(c, x) (l >= 1)
      compute_start[l] = x + l * max(c, x)
      step             = x + c + (L - 1) * max(c, x)

* serial (a policy that must decide before it fetches): decide, then fetch, then compute, layer
  after layer: layer l starts at ``l * (d + x + c)``; the step is ``L * (d + x + c)``.

The engine charges :func:`step_time`; the timeline places its events with :func:`layer_starts`;
``tests/test_timeline.py`` checks both against an event-driven simpy simulation of the same
pipeline. All functions are vectorised over steps (arrays of ``c``, ``d``, ``x``).
"""

from __future__ import annotations

import numpy as np


def step_time(compute, decide, link, layers: int, overlap: bool) -> np.ndarray:
    """Seconds of the layers of one decode step (without the LM head). Overlapped, a decide
    (an engine that overlaps a deciding policy's fetch) runs on the GPU with the compute."""
    if overlap:
        compute = compute + decide
        return link + compute + (layers - 1) * np.maximum(compute, link)
    return layers * (compute + decide + link)


def layer_starts(compute: float, decide: float, link: float, layers: int,
                 overlap: bool) -> tuple[np.ndarray, np.ndarray]:
    """(link start, compute start) of every layer of one step, relative to its start; in serial
    mode the layer's decide starts at ``compute start - link - decide``."""
    l = np.arange(layers, dtype=float)
    if overlap:
        compute = compute + decide
        slot = max(compute, link)
        copy = np.where(l == 0, 0.0, link + (l - 1) * slot)
        return copy, link + l * slot
    start = l * (decide + link + compute)
    return start + decide, start + decide + link
