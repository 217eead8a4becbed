"""VerKV: PoissonComp's sample and a key sketch in HBM, the full cache in host memory, and a
Bernstein certificate that decides per step what to fetch (``../shared/spec/verkv.md``).

``policy`` (the registered policy), ``kvfetch`` (the decide step), ``certificate`` (shrinkage,
the bound, the fetch order), ``sketch`` (the 2-bit key sketch and shortlist), ``bench`` (the decide
step on a synthetic layer, for the profiler's kernel table and kvsim validate)."""

from kvsim.policies.verkv import policy  # noqa: F401  (registers "verkv")
