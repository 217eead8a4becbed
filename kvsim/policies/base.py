"""A policy: one class that compresses a layer's context, attends through what it kept, and turns
measured statistics into a :class:`~kvsim.contract.DecodeCost`. Two kinds:

* a :class:`MaskPolicy` keeps a set of the context in HBM (exact tokens, a sample, a code) and
  never fetches: its ``attend`` returns ``(output, stats)``;
* a :class:`FetchPolicy` keeps the full cache in host memory and decides per step what to fetch:
  its ``attend`` returns ``(output, stats, Reads)``, the tokens it read.

Policies are pure transformations: they never call the measuring code, and they do not count
their own traffic. The callers (``kvsim.measure.harness`` on a trace, ``kvsim.model`` inside a
real model) go through :func:`kvsim.measure.traffic.attend`, which counts what was read from
``Compressed.resident`` and the ``Reads`` and refuses attention that used a context token outside
them; they compare every output with dense attention, aggregate the statistics
(``kvsim.measure.stats``) and ask the policy for its cost.

To add a policy: one file in ``kvsim/policies/`` with one subclass decorated with
:func:`kvsim.policies.register`; options are fields of its ``Params`` dataclass
(``field(default=..., metadata={"help": ..., "choices": [...]})``), written in its spec
(``NAME:key=value``; ``kvsim policies NAME`` lists them), the shared ones
(:mod:`kvsim.policies.options`) also flags. Four kinds to start from, the most specific that
fits:

* :class:`MaskPolicy` keeping exact tokens: say which (``keep``);
* :class:`kvsim.policies.scored.ScoredPolicy`: keep the best-scored share (``score``, and the
  budget rule and selection of ``topk`` or ``poissoncomp`` by subclassing them);
* :class:`kvsim.policies.blocks.BlockFetchPolicy`: fetch whole blocks of the context ranked by a
  small index held in HBM (``block_bytes``, ``index``, ``select``; Quest);
* :class:`FetchPolicy` for anything else (VerKV): ``compress``, ``attend``, ``decode_cost`` and a
  ``decide_kernel`` that returns a :class:`DecideKernel`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

from kvsim._torch import torch
from kvsim.attention.weighted import weighted_attention_chunked
from kvsim.contract import DecodeCost, PrefillWork, kv_token_bytes

KV_ELEM_BYTES = 2  # bytes per K or V element of the cache a policy is costed against (16-bit)


@dataclass
class Compressed:
    """What :meth:`Policy.compress` keeps of one layer's context, per KV head (mean over heads)."""
    state: object  # the policy's own; handed back to :meth:`Policy.attend`
    held_tokens: float  # context tokens whose K/V stay in HBM
    held_bytes: float  # HBM bytes: those tokens' K/V plus ``meta_bytes``
    meta_bytes: float = 0.0  # of which sketch, inclusion probabilities, codec metadata
    info: dict = field(default_factory=dict)  # other per-layer facts, see Policy.summarize
    # (n_kv, n_ctx) bool: the context tokens whose exact K/V ``attend`` may read without fetching
    # (None: none; a codec's own state is not counted here)
    resident: torch.Tensor | None = None


@dataclass
class Reads:
    """What one ``attend`` call of a fetching policy read from host memory, (n_kv, n_ctx) bool
    each: tokens whose K and V it read, and tokens whose K alone it read (a second look)."""
    kv: torch.Tensor
    k: torch.Tensor | None = None


def restate_share(share: float, bytes_then: float, bytes_now: float, trace_head_dim: int,
                  model) -> float:
    """A share of the KV cache measured on a trace (16-bit, ``trace_head_dim``) for metadata of
    ``bytes_then`` bytes per token and KV head, restated for ``model``, where the same metadata
    takes ``bytes_now`` bytes: the share scales with the metadata's bytes over the KV's."""
    if not share or bytes_then <= 0:
        return share
    return share * (bytes_now / bytes_then) * (2 * trace_head_dim * KV_ELEM_BYTES
                                               / kv_token_bytes(model))


@dataclass
class NoParams:
    def validate(self) -> None:
        pass


class Policy(ABC):
    """What both kinds share; subclass :class:`MaskPolicy` or :class:`FetchPolicy`."""
    name: ClassVar[str]
    fetches: ClassVar[bool]  # attend returns Reads (FetchPolicy) or not (MaskPolicy)
    Params: ClassVar[type] = NoParams
    needs_attention: ClassVar[bool] = False  # runs on a trace's attention section
    summary: ClassVar[str] = ""
    # which rows the harness hands ``compress`` as the observation window: "question" (the last
    # question rows: the query-aware setting) or "context" (the last context rows; none in a trace
    # without them, and the trace's "snapkv" scores stand in)
    observation: ClassVar[str] = "question"
    times_compress: ClassVar[bool] = False  # the harness times compress against dense prefill

    def __init__(self, params):
        self.params = params
        self.rope: dict = {}
        self.notes: set[str] = set()  # what the policy adapted to a trace (reported as warnings)
        self.sink_local: tuple[int, int] = (0, 0)  # the sizes the last budget resolved

    def budget(self, n_ctx: int, sketch_tokens: float = 0.0, need_sample: bool = True) -> float:
        """Tokens per KV head left for the sample at this context, after sink, local (as given,
        or the defaults shrunk to fit: noted) and the sketch; sets ``sink_local``."""
        from kvsim.policies.options import check_budget
        p = self.params
        b = check_budget(self.name, n_ctx, p.compression, p.sink, p.local, sketch_tokens,
                         need_sample)
        if b.note:
            self.notes.add(b.note)
        self.sink_local = (b.sink, b.local)
        return b.left

    def bind(self, rope: dict, head_dim: int) -> None:
        """Called once before ``compress`` with the model's RoPE settings and head size."""
        self.rope = dict(rope or {})

    def check(self, trace) -> None:  # noqa: B027  (optional: most policies run on any trace)
        """Before any work on ``trace``: a one-line error if this policy cannot run on it."""

    @abstractmethod
    def compress(self, k: torch.Tensor, v: torch.Tensor, scores: dict[str, torch.Tensor],
                 obs_q: torch.Tensor, obs_pos: torch.Tensor, generator: torch.Generator,
                 layer: int, obs_k: torch.Tensor | None = None) -> Compressed:
        """After the context prefill of layer ``layer``, decide what stays resident.

        ``k``, ``v``: (n_kv, n_ctx, d) post-RoPE keys and values of the context; ``scores``:
        per-token scorer outputs (n_kv, n_ctx) the trace or model provides (e.g. "kvzip");
        ``obs_q``, ``obs_pos``: (n_q, w, d) observation-window queries and their positions;
        ``obs_k``: (n_kv, a, d) the keys after the context (positions n_ctx ..) where the window
        lies after it (question rows), which SnapKV's softmax includes; None otherwise.
        (A mask policy keeps exact tokens by default: :meth:`MaskPolicy.compress`.)
        """

    @abstractmethod
    def attend(self, state, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor):
        """Attention of query rows ``q`` (n_q, m, d) at positions ``q_pos`` (m,).

        ``k``, ``v`` (n_kv, n, d) hold the full cache: the context (as given to
        :meth:`compress`; only its resident tokens and, for a fetching policy, the tokens it
        reports in ``Reads`` may be used) followed by the tokens appended since (question and
        decoded tokens, always exact). Returns the output (n_q, m, d), per-decision statistics
        (tensors of shape (n_q, m); names in :mod:`kvsim.measure.stats`; ``kv_read_frac`` is
        the caller's to count) and, for a :class:`FetchPolicy`, the :class:`Reads`.
        """

    def summarize(self, infos: list[dict]) -> dict:
        """Run statistics from the ``Compressed.info`` of every compressed layer (default: none)."""
        return {}

    @abstractmethod
    def decode_cost(self, stats: dict, model) -> DecodeCost:
        """The cost the simulator charges for serving ``model`` (a ModelSpec, or a
        :class:`~kvsim.contract.HeadShape`: every byte count uses its ``head_dim`` and
        ``kv_elem``), from the statistics the harness measured (keys of
        :mod:`kvsim.measure.stats`, plus ``resident_frac``, ``meta_frac`` and ``head_dim`` (the
        trace's) for policies that run on attention; an empty dict for those that need none).
        A share measured on the trace's head size that depends on it (metadata bytes per token
        over the KV bytes per token) is restated for ``model``: :func:`restate_share`."""

    def prefill_work(self, model) -> PrefillWork:
        """The policy's own work after a context's prefill on ``model`` (a ModelSpec: layers,
        heads, head dim, dtype), counted from its algorithm: FLOPs and HBM bytes per context
        token (and per token squared). Default: none."""
        return PrefillWork()

    def provenance(self, stats: dict) -> str:
        """What the report should add about where this policy's figures came from."""
        return ""

    def definition_stats(self) -> dict:
        """Statistics a policy that needs no trace knows by definition."""
        return {}


class MaskPolicy(Policy):
    """Keeps a set of the context in HBM and never fetches. By default the set is exact tokens
    (:meth:`keep`) and attention is exact over them; a policy with weights or a code overrides
    :meth:`compress` and :meth:`attend`."""
    fetches = False

    def keep(self, k: torch.Tensor) -> torch.Tensor:
        """(n_kv, n_ctx) bool: the context tokens kept, from the keys ``k`` (n_kv, n_ctx, d)."""
        return torch.ones(k.shape[:2], dtype=torch.bool, device=k.device)

    def compress(self, k, v, scores, obs_q, obs_pos, generator, layer, obs_k=None):
        keep = self.keep(k)
        held = float(keep.sum(-1).to(torch.float64).mean())
        log_w = torch.zeros(keep.shape, dtype=k.dtype, device=k.device).masked_fill(
            ~keep, float("-inf"))
        return Compressed(log_w, held, held * 2 * k.shape[-1] * KV_ELEM_BYTES, resident=keep)

    def attend(self, log_w, q, q_pos, k, v):
        """Exact attention over the tokens ``log_w`` keeps (0: kept, -inf: dropped; a finite
        weight reweights)."""
        g = q.shape[0] // k.shape[0]
        lw = log_w.to(q.dtype).repeat_interleave(g, dim=0)[:, None, :]
        out, log_d = weighted_attention_chunked(q, q_pos, k, v, lw)
        return out, {"log_denominator": log_d}


@runtime_checkable
class DecideStep(Protocol):
    """What ``kvsim profile`` times (``profiler.kernels.sweep_decide``): one policy's decide
    step for one layer of one request (or of ``B`` requests stacked along the head axis)."""
    fetched_frac: float  # mean share of the context fetched per (stacked) KV head

    def plan(self) -> object:
        """The timed call: one real decision for the decode query."""
        ...


@runtime_checkable
class DecideKernel(DecideStep, Protocol):
    """What :meth:`FetchPolicy.decide_kernel` returns: the step the profiler times, and what
    ``kvsim validate`` (``kvsim.validate``) needs to run it inside real decode steps and to
    analyse the policy on the same layer. The compact layout is per (stacked) KV head: its
    ``resident`` tokens first (filled once), then the rows each decision fetches, ``t_max`` slots
    in all. :class:`kvsim.policies.bench_requests.CompactBench` implements all of it from a
    policy's decision (:class:`kvsim.policies.blocks.BlockBench` for a block policy)."""
    trace: object  # a kvsim.trace.Trace holding the one (stacked) layer decided on
    t_max: int  # slots of the compact layout per KV head
    resident: torch.Tensor  # (kv_heads,) resident tokens per KV head, at the layout's head

    def plan(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fetch set as host row indices ``h * n + t`` (sorted by KV head), their slots
        ``h * t_max + s`` in the compact layout, an additive logit bias (kv_heads, group,
        t_max) over the layout (-inf on unused slots) and the rows fetched per KV head."""
        ...

    def stack(self, batch: int) -> DecideKernel:
        """The same step for ``batch`` requests decided in one call (this one is request 0);
        ``stack(1)`` is this kernel."""
        ...


class FetchPolicy(Policy):
    """Keeps the full cache in host memory and decides per step what to fetch; ``attend``
    returns ``(output, stats, Reads)``. A policy whose fetch is decided by a kernel (not "all of
    it") names that kernel: its :class:`~kvsim.contract.DecodeCost` sets ``decide_kernel`` to
    the policy's name, and :meth:`decide_kernel` builds it for the profiler."""
    fetches = True

    def decide_kernel(self, device, model, context: int, seed: int = 0) -> DecideKernel | None:
        """The policy's decide step for one layer and sequence on a synthetic layer of
        ``model``'s head shape (a :class:`DecideKernel`): ``kvsim profile`` times its ``plan()``
        and ``kvsim validate`` runs it inside real decode steps. None for a policy that fetches
        without deciding (dense offload)."""
        return None
