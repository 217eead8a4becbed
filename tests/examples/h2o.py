"""H2O (Zhang et al., 2023), heavy-hitter eviction, as a scored mask policy.

Per layer and KV head it keeps ``n_ctx / compression`` context tokens: the ``sink`` first and
``local`` last ones and the heavy hitters, the tokens with the largest attention accumulated from
the observation window (the last question rows; softmax attention summed over the rows and over
the query heads of the KV head). H2O accumulates while it decodes; a trace holds no queries of
the context itself, so the window stands for the steps seen so far. Top-k's budget rule and
selection are reused as they are: only the score is H2O's (:meth:`ScoredPolicy.score`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.attention.scoring import attention_mass
from kvsim.contract import PrefillWork
from kvsim.errors import KvsimError
from kvsim.policies import options as O
from kvsim.policies.scorers import OBS_WINDOW, scoring_work
from kvsim.policies.topk import TopK


@dataclass
class H2OParams:
    compression: float = O.compression_field()
    sink: int = O.sink_field()
    local: int = O.local_field()


class H2O(TopK):
    name = "h2o"
    Params = H2OParams
    summary = ("heavy hitters: keeps sink + local + the tokens the observation window attended "
               "most (1/compression of the cache); the rest are dropped")

    def score(self, k, scores, obs_q, obs_pos, obs_k=None):
        if not obs_q.shape[1]:
            raise KvsimError("h2o accumulates the attention of the observation window: this "
                             "trace has no question rows")
        return attention_mass(k, obs_q[:, -OBS_WINDOW:], obs_pos[-OBS_WINDOW:], k_after=obs_k)

    def prefill_work(self, model):
        """The window's queries against every context key: SnapKV's count (H2O does not pool)."""
        flops, flops2, hbm, _ = scoring_work("snapkv", model)
        return PrefillWork(flops, flops2, hbm, f"modelled: H2O: {OBS_WINDOW} window queries x "
                                               f"every context key, per query head")
