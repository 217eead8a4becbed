"""Quest: query-aware page selection (Tang et al., 2024) with the cache in host memory.

``pages`` (the key bounds per page and the selection of the best pages) and ``policy`` (the
registered policy: per page of keys the channel-wise min and max stay on the GPU, each step
fetches the pages with the highest upper bound on q.k within a token budget). The rest (the
resident set, attention, statistics, cost, and the decide step on a synthetic layer for the
profiler's kernel table and kvsim validate) is :mod:`kvsim.policies.blocks`, shared by every
block-selecting policy."""

from kvsim.policies.quest import policy  # noqa: F401  (registers "quest")
