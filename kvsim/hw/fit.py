"""The link model both ends share: the profiler fits it to what it measured, the cost model to a
profile's tables. Torch-free, like the catalog."""

from __future__ import annotations

import numpy as np

from kvsim.errors import KvsimError


def fit_alpha_beta(nbytes: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """Least-squares fit of ``t = alpha + n / beta``, weighted by 1/t so small copies count.

    Where noise makes the line fall with size (a few sizes timed on a busy machine), the
    bandwidth is the largest copy's rate and ``alpha`` the smallest time left over: the link
    is still described by what was measured. Times that are not positive are an error."""
    n, t = np.asarray(nbytes, float), np.asarray(seconds, float)
    if len(n) == 0 or (t <= 0).any() or not np.isfinite(t).all():
        raise KvsimError("measured link times must be positive and finite to fit a bandwidth")
    w = 1.0 / t
    A = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, inv_beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    if inv_beta <= 0:
        big = int(np.argmax(n))
        beta = n[big] / t[big]
        return max(0.0, float((t - n / beta).min())), float(beta)
    return max(float(alpha), 0.0), 1.0 / float(inv_beta)
