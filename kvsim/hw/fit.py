"""The link model both ends share: the profiler fits it to what it measured, the cost model to a
profile's tables. Torch-free, like the catalog."""

from __future__ import annotations

import numpy as np

from kvsim.errors import KvsimError


def fit_alpha_beta(nbytes: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """Least-squares fit of ``t = alpha + n / beta``, weighted by 1/t so small copies count."""
    n, t = np.asarray(nbytes, float), np.asarray(seconds, float)
    w = 1.0 / t
    A = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, inv_beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    if inv_beta <= 0:
        raise KvsimError("measured link times do not grow with size; cannot fit a bandwidth")
    return max(float(alpha), 0.0), 1.0 / float(inv_beta)
