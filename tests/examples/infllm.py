"""InfLLM-style block retrieval (Xiao et al., 2024) as a block-selecting fetching policy.

The context is cut into blocks of ``block_size`` tokens, each represented in HBM by
``representatives`` of its keys (fp16). A decision scores every block by the query's logits on
its representatives, summed over them and over the query heads of the KV head (InfLLM's relevance
of a memory unit), and reads the best ``token_budget / block_size`` blocks from host memory;
attention is exact over them, ``sink`` and ``local``. InfLLM's representatives are the tokens
their block's own queries attended most; a trace holds no queries of the context, so here they
are the keys nearest their block's mean key (a partial last block repeats its last key).
:class:`~kvsim.policies.blocks.BlockFetchPolicy` does the rest, decide bench included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsim._torch import F, torch
from kvsim.errors import KvsimError
from kvsim.policies import options as O
from kvsim.policies.blocks import BlockFetchPolicy, top_blocks

REP_BYTES = 2  # a representative key's elements, kept at 16 bits


@dataclass
class InfLLMParams:
    block_size: int = field(default=128, metadata={
        "kind": int, "help": "tokens per block: the unit InfLLM scores and fetches"})
    representatives: int = field(default=4, metadata={
        "kind": int, "help": "keys per block kept in HBM to score it"})
    token_budget: int = field(default=2048, metadata={
        "kind": int, "help": "context tokens each KV head reads per step (whole blocks)"})
    sink: int = O.shared("sink", 4)
    local: int = O.shared("local", 4)

    def validate(self) -> None:
        sizes = (self.representatives, self.block_size, self.token_budget)
        if not (all(isinstance(s, int) for s in sizes) and 1 <= sizes[0] <= sizes[1] <= sizes[2]):
            raise KvsimError(f"infllm needs whole numbers 1 <= representatives <= block_size <= "
                             f"token_budget; got {sizes}")


class InfLLM(BlockFetchPolicy):
    name = "infllm"
    Params = InfLLMParams
    summary = ("blocks of the context in host memory, each represented by a few keys in HBM; "
               "each step fetches the blocks whose representatives score best")

    def index(self, k):
        """(n_kv, blocks, representatives, d): per block the keys nearest its mean key."""
        n_kv, n, d = k.shape
        b, r = self.params.block_size, self.params.representatives
        pad = -n % b
        kb = F.pad(k.transpose(1, 2), (0, pad), mode="replicate").transpose(1, 2)
        kb = kb.reshape(n_kv, (n + pad) // b, b, d)
        near = torch.einsum("hpbd,hpd->hpb", kb, kb.mean(2)).topk(r, dim=-1).indices
        return kb.gather(2, near[..., None].expand(-1, -1, -1, d))

    def block_bytes(self, model):
        return self.params.representatives * model.head_dim * REP_BYTES

    def select(self, state, q, q_pos, budget):
        reps = state.index
        n_kv, _, _, d = reps.shape
        grouped = q.view(n_kv, q.shape[0] // n_kv, q.shape[1], d)
        relevance = torch.einsum("hgmd,hprd->hmp", grouped, reps.to(q.dtype))
        return top_blocks(relevance, q_pos, state, budget)
