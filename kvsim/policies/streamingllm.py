"""StreamingLLM (Xiao et al., 2024): the first ``sink`` tokens (attention sinks) and the last
``local`` tokens of the context stay in HBM, exact; the rest are dropped. Fixed token counts,
whatever the context: charged as such, not as a share of the trace it was measured on."""

from __future__ import annotations

from dataclasses import dataclass

from kvsim._torch import torch
from kvsim.contract import DecodeCost
from kvsim.errors import KvsimError
from kvsim.policies import options as O
from kvsim.policies.base import MaskPolicy
from kvsim.policies.registry import register


@dataclass
class StreamingParams:
    sink: int = O.shared("sink", 4)
    local: int = O.shared("local", 1020)

    def validate(self) -> None:
        if self.sink + self.local < 1:  # each is a whole number >= 0 (the shared check)
            raise KvsimError("streamingllm keeps sink + local >= 1 tokens; got none")


@register
class StreamingLLM(MaskPolicy):
    name = "streamingllm"
    Params = StreamingParams
    needs_attention = True
    summary = "attention sinks + a recent window in HBM (fixed token counts); the rest dropped"

    def keep(self, k):
        pos = torch.arange(k.shape[1], device=k.device)
        return ((pos < self.params.sink) | (pos >= k.shape[1] - self.params.local)).expand(
            k.shape[:2])

    def decode_cost(self, stats, model):
        kept = float(self.params.sink + self.params.local)
        return DecodeCost(resident_frac=0.0, hbm_read_frac=0.0, host_read_frac=0.0,
                          host_frac=0.0, overlap=False, resident_tokens=kept,
                          hbm_read_tokens=kept)
