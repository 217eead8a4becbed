"""What engine steps cost: decode tokens of the running sequences and, in the same forward pass,
prefill chunks of newly admitted prompts. Vectorised over a run of steps.

Per layer of a step with ``D`` decoding sequences holding ``tokens`` KV tokens and prefill chunks
(``size`` new tokens after ``prefix`` cached ones each):

    c = GEMMs + decode attention (KV read from HBM) + chunk attention
        GEMMs = max(decode GEMM time(D), one pass over the layer's weights (of an MoE layer:
                    the experts the step's tokens route to),
                    2 * active_layer_params * (D + chunk tokens) / FLOP/s)
        chunk attention = causal attention FLOPs of the chunks (ModelSpec.prefill_flops) / FLOP/s
    d = the policy's decide step, per decoding sequence
    x = the policy's KV transfer of the decoding sequences over the host link

and the layers form the pipeline of :mod:`kvsim.sim.pipeline`. A sequence of ``n`` tokens
reads ``DecodeCost.tokens(term, n)`` tokens' worth of KV from HBM and over the link: a share of
``n`` plus a fixed count, at most ``n``. For a policy whose terms are shares only (every fixed
count 0) that is ``frac * T`` of the batch's ``T`` tokens, affine, and decode runs have a closed
form; with fixed counts each sequence is charged on its own (``held``: the sequences' tokens).

Per step: the LM head for every sequence that emits a token (decodes and chunks that finish a
prompt), the policy's own prefill work (:class:`kvsim.contract.PrefillWork`) for every prompt
that finishes, and, for policies that keep the cache in host memory, the chunks' KV written to
host memory (D2H, overlapped with the step). A step without chunks is a plain decode step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from kvsim.contract import DecodeCost, PrefillWork
from kvsim.hw.catalog import ModelSpec
from kvsim.hw.costs import CostModel
from kvsim.sim.pipeline import step_time
from kvsim.sim.records import Chunks


def _step_time(compute: float, decide: float, link: float, layers: int, overlap: bool) -> float:
    """:func:`kvsim.sim.pipeline.step_time` of one step, in Python floats."""
    if overlap:
        compute += decide
        return link + compute + (layers - 1) * max(compute, link)
    return layers * (compute + decide + link)


class KvBytes:
    """Whole bytes a request of ``n`` tokens holds: in HBM its resident state plus the staging
    of its transfers (``staging_layers`` of the KV it reads over the link), in host memory what
    the policy keeps there; each term ``DecodeCost.tokens(term, n)`` tokens' worth of KV. A
    policy of shares only holds ``hbm_per_token`` and ``host_per_token`` bytes per token
    (``math.ceil(hbm_per_token * n)`` is :meth:`hbm_need` of one request, in scalars)."""

    def __init__(self, model: ModelSpec, policy: DecodeCost):
        p, kv = policy, model.kv_bytes_per_token
        self.policy, self.kv, self.fixed = p, kv, p.fixed
        self.staging = p.staging_layers / model.layers
        self.hbm_per_token = (p.resident_frac + self.staging * p.host_read_frac) * kv
        self.host_per_token = p.host_frac * kv

    def hbm_need(self, tokens) -> np.ndarray:
        """HBM bytes of requests of ``tokens`` tokens (an array of them, or one)."""
        if not self.fixed:
            return np.ceil(self.hbm_per_token * np.asarray(tokens, float)).astype(np.int64)
        p = self.policy
        held = p.tokens("resident", tokens) + self.staging * p.tokens("host_read", tokens)
        return np.ceil(self.kv * held).astype(np.int64)

    def host_need(self, tokens) -> np.ndarray:
        if not self.fixed:
            return np.ceil(self.host_per_token * np.asarray(tokens, float)).astype(np.int64)
        return np.ceil(self.kv * self.policy.tokens("host", tokens)).astype(np.int64)


@dataclass
class StepCosts:
    model: ModelSpec
    costs: CostModel
    policy: DecodeCost
    prefill_work: PrefillWork = field(default_factory=PrefillWork)
    ahead: bool = True  # price every decode batch size up to 2B at the first (a run asks many)

    def __post_init__(self):
        self._per_batch: dict[int, tuple[float, float]] = {}
        self._lines: dict[int, tuple] = {}
        self._forms: dict[int, tuple | None] = {}
        self._copies: dict[int, float] = {}  # link copies of a step's D2H write, per chunks
        # a step's (GEMM, all-reduce) seconds per layer, by its tokens
        self._gemm_at: dict[float, tuple[float, float]] = {}
        self._decoding: dict[int, tuple | None] = {}  # (line..., GEMM, LM head) per decode batch
        self._kv_bytes = self.model.kv_bytes_per_token
        self._host_kv = self.policy.host_frac * self._kv_bytes  # (host_bytes, per token)
        self._d2h = self.costs.links.get("d2h")
        m, c, p = self.model, self.costs, self.policy
        self.overlap = c.overlap_for(p.overlap)
        self.fixed = p.fixed  # some term holds a fixed token count: charged per sequence
        self.fetches = p.host_read_frac > 0 or p.host_read_tokens > 0
        self.writes = p.host_frac > 0 or p.host_tokens > 0  # prefilled KV goes to host memory
        w = self.prefill_work
        self.works = bool(w.flops_per_token or w.flops_per_token_sq or w.bytes_per_token)
        self.overhead = c.step_overhead + m.layers * c.layer_overhead
        # an eager engine's host launches a step's kernels while the GPU runs those launched
        # before: the layers take at least the launches (``floor``, beside their GPU overhead)
        self.floor = max(0.0, m.layers * (c.launch_overhead - c.layer_overhead))
        self.attn_rate = c.flops * c.prefill_attention_efficiency  # prefill attention FLOP/s
        self.matmuls = c.matmuls(m)
        self.reread = c.attention_reread(m)  # KV heads read once per query head, or once
        self.decide = c.decide_model(p.decide_kernel, m, p.decide_bytes_per_token) \
            if p.decide_bytes_per_token > 0 else None
        if self.decide is not None and c.tp > 1:  # each GPU decides for its share of the heads
            self.decide = dataclasses.replace(self.decide, **{
                f: getattr(self.decide, f) / c.tp
                for f in ("per_layer_us", "per_ktoken_us", "per_kfetched_us")})

    def per_batch(self, B: int) -> tuple[float, float]:
        """(GEMM seconds per layer, LM head seconds) of a decode batch of ``B`` sequences,
        remembered: a run asks for the same few batch sizes thousands of times."""
        got = self._per_batch.get(B)
        if got is None:
            m, c = self.model, self.costs
            if self.ahead and c.gemm_curve is None and c.head_curve is None:  # up to 2B
                sizes = np.arange(1, max(2 * B, 64) + 1)  # (elementwise: the same floats)
                self._per_batch.update(zip(sizes.tolist(), zip(
                    c.gemm_time(sizes, m).tolist(), c.head_time(sizes, m).tolist())))
                return self._per_batch[B]
            got = self._per_batch[B] = (float(c.gemm_time(B, m)), float(c.head_time(B, m)))
        return got

    def host_bytes(self, tokens, written=None) -> np.ndarray:
        """Bytes of KV the policy writes to host memory for ``tokens`` prompt tokens: its share,
        or ``written`` tokens' worth (:meth:`written`) where the host term has a fixed count."""
        if written is not None:
            return self.model.kv_bytes_per_token * np.asarray(written, float)
        return self.policy.host_frac * self.model.kv_bytes_per_token * np.asarray(tokens, float)

    def charged_steps(self, held, k: int) -> tuple[np.ndarray, np.ndarray]:
        """KV tokens read from HBM and over the link in each of the next ``k`` decode steps of
        sequences holding ``held`` tokens each (each step adds one to every sequence), (k,)."""
        n = np.asarray(held, float)[None, :] + np.arange(k, dtype=float)[:, None]
        p = self.policy
        return p.tokens("hbm_read", n).sum(1), p.tokens("host_read", n).sum(1)

    def charged(self, held) -> tuple[float, float]:
        """:meth:`charged_steps` of one step, in floats."""
        read, fetch = self.charged_steps(held, 1)
        return float(read[0]), float(fetch[0])

    def written(self, prefixes, sizes) -> float:
        """Tokens' worth of KV that chunks of ``sizes`` tokens after ``prefixes`` add to their
        sequences' host-memory term (what a step writes to host memory)."""
        a, b = np.asarray(prefixes, float), np.asarray(sizes, float)
        p = self.policy
        return float((p.tokens("host", a + b) - p.tokens("host", a)).sum())

    def charges_of(self, plans) -> tuple:
        """(KV read, link read) of each of a run of planned steps' decodes, (S,) each; None and
        None for a policy of shares only (charged from the steps' tokens)."""
        if not self.fixed:
            return None, None
        return (np.array([s.read_tokens or 0.0 for s in plans]),
                np.array([s.fetch_tokens or 0.0 for s in plans]))

    def layer_costs(self, D, tokens, read=None, fetch=None) -> tuple[np.ndarray, np.ndarray,
                                                                       np.ndarray]:
        """Per-layer (decode compute, decide, link) seconds of steps whose decodes are ``D``
        sequences holding ``tokens`` KV tokens, each (S,); ``read`` and ``fetch``: the KV
        tokens they read from HBM and over the link where some term is fixed (:meth:`charged`;
        if not given, each sequence is taken to hold ``tokens / D``)."""
        m, c, p = self.model, self.costs, self.policy
        tokens = np.asarray(tokens, float)
        gemm = (self.per_batch(D)[0] if D else 0.0) if isinstance(D, int) else \
            np.where(np.asarray(D) > 0, c.gemm_time(D, m), 0.0)
        if self.fixed:
            if read is None:
                n = tokens / np.maximum(np.asarray(D, float), 1.0)
                read, fetch = (np.asarray(D, float) * p.tokens(t, n)
                               for t in ("hbm_read", "host_read"))
            per_layer = m.kv_bytes_per_token / m.layers
            read, fetch = np.asarray(read, float), np.asarray(fetch, float)
            compute = gemm + c.attention_time(self.reread * per_layer * read,
                                              self.reread * read) + c.allreduce_time(D, m)
            link = c.link_time(per_layer * fetch, p.path, copies=c.copies(
                p.copies_per_layer, D)) if self.fetches else np.zeros_like(tokens)
            decide = self.decide.seconds(D, tokens, fetch / np.maximum(tokens, 1.0)) \
                if self.decide is not None else np.zeros_like(tokens)
            return compute, decide, link
        kv_layer = m.kv_bytes_per_token / m.layers * tokens  # bytes of one layer's KV
        read = self.reread * p.hbm_read_frac
        compute = gemm + c.attention_time(read * kv_layer, read * tokens) \
            + c.allreduce_time(D, m)
        link = c.link_time(p.host_read_frac * kv_layer, p.path,
                           copies=c.copies(p.copies_per_layer, D)) \
            if p.host_read_frac > 0 else np.zeros_like(tokens)
        decide = self.decide.seconds(D, tokens, p.host_read_frac) \
            if self.decide is not None else np.zeros_like(tokens)
        return compute, decide, link

    def run(self, D, tokens, chunks: Chunks | None = None, read=None, fetch=None):
        """(step, GPU-busy, link-busy, decodes-alone) seconds of each of a run of steps, (S,)
        each; decodes-alone is what the decode tokens of the step would take without chunks.
        Every step pays the engine's per-step overhead (time the GPU is not busy); ``read``,
        ``fetch``: as :meth:`layer_costs`."""
        m, c = self.model, self.costs
        L, ovh = m.layers, self.overhead
        D = np.asarray(D, float)
        if D.any():
            compute, decide, link = self.layer_costs(D, tokens, read, fetch)
            head = np.where(D > 0, c.head_time(D, m), 0.0)
            alone = np.where(D > 0, np.maximum(step_time(compute, decide, link, L, self.overlap)
                                               + head, self.floor) + ovh, 0.0)
        else:  # prefill only: no decode work at all
            compute = decide = link = head = alone = np.zeros_like(D)
        if chunks is None:
            return alone, L * (compute + decide) + head, L * link, alone
        dec_gemm = np.where(D > 0, c.gemm_time(D, m), 0.0) if D.any() else 0.0
        gemm = np.maximum(dec_gemm, self.matmuls.time(D + chunks.tokens))
        compute = compute - dec_gemm + gemm + chunks.attn_flops / L / self.attn_rate \
            + c.allreduce_time(D + chunks.tokens, m) - c.allreduce_time(D, m)
        layers = step_time(compute, decide, link, L, self.overlap)
        emit = D + chunks.done
        extra = np.where(emit > 0, c.head_time(emit, m), 0.0) + np.maximum(
            chunks.work_flops / c.flops, chunks.work_bytes / c.hbm_bw)
        write = c.link_time(self.host_bytes(chunks.tokens, chunks.written), "d2h",
                            copies=2 * L * c.copies(1.0, chunks.count)) \
            if self.writes else np.zeros_like(layers)
        return (np.maximum(np.maximum(layers + extra, write), self.floor) + ovh,
                L * (compute + decide) + extra,
                L * link + write, alone)

    def step(self, D: int, tokens: float, chunk_tokens: float, attn_flops: float, count: int,
             done, read: float | None = None, fetch: float | None = None,
             written: float | None = None) -> tuple[float, float, float, float]:
        """:meth:`run` for one step, in scalars (the engine's hot path: most runs of prefill
        steps are one step long): ``D`` decodes holding ``tokens`` KV tokens, ``count`` chunks
        of ``chunk_tokens`` tokens in all with ``attn_flops`` of attention, ``done``: the
        lengths of the prompts that finish (a sequence of floats); ``read``, ``fetch``: as
        :meth:`layer_costs`; ``written``: as :meth:`host_bytes`. ``tests/test_serving.py``
        holds the two equal. (``b if b > a else a`` is ``max(a, b)``, the same float, without
        the call: a tenth of its time.)"""
        m, c, p = self.model, self.costs, self.policy
        L, ovh, overlap, floor = m.layers, self.overhead, self.overlap, self.floor
        gemm_d = attn = link = decide = alone = 0.0
        dec = self._decoding.get(D, 0) if D and tokens > 0 else None
        if dec == 0:
            line = self._line(D)
            dec = self._decoding[D] = None if line is None else (*line[0], *line[1], *line[2],
                                                                 *self.per_batch(D))
        if dec is not None:  # roofline costs: the remembered affine parts, in scalars
            c0, c1, d0, d1, x0, x1, gemm_d, head_d = dec
            attn, decide, link = c1 * tokens, d0 + d1 * tokens, x0 + x1 * tokens
            if overlap:  # (_step_time, inlined)
                compute_d = c0 + attn + decide
                alone = link + compute_d + (L - 1) * (link if link > compute_d else compute_d) \
                    + head_d
            else:
                alone = L * (c0 + attn + decide + link) + head_d
            alone = (alone if alone > floor else floor) + ovh
        elif D and self.fixed:
            gemm_d, head_d = self.per_batch(D)
            compute, decide, link = (float(x[0]) for x in self.layer_costs(
                D, np.array([tokens]), None if read is None else [read],
                None if fetch is None else [fetch]))
            attn = compute - gemm_d - float(c.allreduce_time(D, m))
            alone = float(step_time(compute, decide, link, L, self.overlap)) + head_d
            alone = (alone if alone > floor else floor) + ovh
        elif D:
            gemm_d, head_d = self.per_batch(D)
            kv_layer = m.kv_bytes_per_token / L * tokens
            read = self.reread * p.hbm_read_frac
            attn = float(c.attention_time(read * kv_layer, read * tokens))
            if p.host_read_frac > 0:
                link = float(c.link_time(p.host_read_frac * kv_layer, p.path,
                                         copies=c.copies(p.copies_per_layer, D)))
            if self.decide is not None:
                decide = float(self.decide.seconds(D, tokens, p.host_read_frac))
            alone = float(step_time(gemm_d + attn + float(c.allreduce_time(D, m)), decide, link, L,
                                    self.overlap)) + head_d
            alone = (alone if alone > floor else floor) + ovh
        n = D + chunk_tokens
        got = self._gemm_at.get(n)
        if got is None:  # (tensor parallel: the all-reduces)
            got = self._gemm_at[n] = (self.matmuls.at(n), float(c.allreduce_time(n, m))
                                      if c.tp > 1 else 0.0)
        at, reduce = got
        compute = attn + (at if at > gemm_d else gemm_d) + attn_flops / L / self.attn_rate \
            + reduce
        if overlap:  # (_step_time, inlined)
            compute_d = compute + decide
            layers = link + compute_d + (L - 1) * (link if link > compute_d else compute_d)
        else:
            layers = L * (compute + decide + link)
        emit = D + len(done)
        extra = (self._per_batch.get(emit) or self.per_batch(emit))[1] if emit else 0.0
        if self.works:
            work = self.prefill_work
            extra += sum(max(work.flops(x) / c.flops, work.bytes(x) / c.hbm_bw) for x in done)
        write = self._write(chunk_tokens, written, count) if self.writes and count else 0.0
        busy = layers + extra
        took = write if write > busy else busy
        return ((took if took > floor else floor) + ovh, L * (compute + decide) + extra,
                L * link + write, alone)

    def _write(self, chunk_tokens: float, written: float | None, count: int) -> float:
        """Seconds of one step's D2H write of ``count`` chunks (:meth:`run`'s ``write``), in
        floats where the link is a line (the copies remembered per chunk count)."""
        copies = self._copies.get(count)
        if copies is None:
            c = self.costs
            copies = self._copies[count] = float(2 * self.model.layers * c.copies(1.0, count))
        nbytes = self._kv_bytes * written if written is not None else \
            self._host_kv * float(chunk_tokens)
        link = self._d2h
        if link.curve is not None:
            return float(link.time(nbytes, copies))
        copies = 1.0 if 1.0 > copies else copies  # (LinkPath.time in floats: the max)
        return copies * (link.alpha + nbytes / copies / link.beta) if nbytes > 0 else 0.0

    def decode(self, ctx: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Times of the next ``k`` decode steps of a fixed batch with contexts ``ctx`` (each step
        adds a token per sequence): (step, GPU-busy, link-busy) seconds, each (k,): :meth:`run`
        without chunks, for a batch size that does not change."""
        return self._decode(len(ctx), float(ctx.sum()), k, ctx if self.fixed else None)

    def _decode(self, B: int, tokens: float, k: int, held: np.ndarray | None = None):
        L, j = self.model.layers, np.arange(k, dtype=float)
        read, fetch = (None, None) if held is None else self.charged_steps(held, k)
        compute, decide, link = self.layer_costs(B, tokens + B * j, read, fetch)
        head = self.per_batch(B)[1]
        return (np.maximum(step_time(compute, decide, link, L, self.overlap) + head, self.floor)
                + self.overhead,
                L * (compute + decide) + head, L * link)

    def _line(self, B: int) -> tuple | None:
        """Per layer (compute, decide, link) of a decode step of ``B`` sequences as affine
        functions of their KV tokens ``T > 0``, each ``(at 0, per token)``; None where a
        measured curve makes a cost non-linear or a fixed term charges each sequence at most
        its length. Remembered per batch size."""
        got = self._lines.get(B, 0)
        if got == 0:
            c = self.costs
            if c.attn_curve is None and c.links[self.policy.path].curve is None and \
                    not self.fixed and c.gemm_curve is None:  # every size up to 2B at once
                sizes = np.arange(1, max(2 * B, 64) + 1)
                self.per_batch(B)
                ta, tb = 1e3, 1e6  # (elementwise: the same floats as one size at a time)
                parts = [np.broadcast_to(p, (len(sizes), 2)) for p in
                         self.layer_costs(sizes[:, None], np.array([ta, tb]))]
                per = [((p[:, 1] - p[:, 0]) / (tb - ta)).tolist() for p in parts]
                at0 = [(p[:, 0] - (p[:, 1] - p[:, 0]) / (tb - ta) * ta).tolist() for p in parts]
                for j, n in enumerate(sizes.tolist()):
                    self._lines[n] = tuple((at0[t][j], per[t][j]) for t in range(3))
                return self._lines[B]
            self._lines[B] = None
            return None
        return got

    def _form(self, B: int) -> tuple | None:
        """The closed form of a decode step of ``B`` sequences (None where costs are not
        affine): per layer the GPU's share ``g0 + g1 T`` and the link's ``x0 + x1 T`` of ``T``
        KV tokens, the step's layers ``s0 + s1 T`` where the GPU sets the pace and where the
        link does (None: no overlap, one form), and the LM head's seconds."""
        line = self._line(B)
        if line is None:
            return None
        (c0, c1), (d0, d1), (x0, x1) = line
        L, head = self.model.layers, self.per_batch(B)[1]
        g0, g1 = c0 + d0, c1 + d1
        if not self.overlap:
            return g0, g1, x0, x1, (L * (c0 + d0 + x0), L * (c1 + d1 + x1)), None, head
        return (g0, g1, x0, x1, (x0 + g0 + (L - 1) * g0, x1 + g1 + (L - 1) * g1),
                (x0 + g0 + (L - 1) * x0, x1 + g1 + (L - 1) * x1), head)

    def decode_run(self, B: int, T0: float, k: int, until: float = np.inf,
                   held: np.ndarray | None = None, gaps=None):
        """The next decode steps of a fixed batch of ``B`` sequences holding ``T0`` KV tokens
        (``held`` of them each, where some term is fixed; each step adds a token per
        sequence): at most ``k``, ending with the first step that
        ends at or after ``until`` seconds. Returns (steps, seconds, GPU-busy, link-busy), the
        last three summed over the steps; ``gaps`` (a :class:`kvsim.sim.metrics.Gaps`) gets
        each step's seconds for each of its ``B`` tokens. In closed form when a step's time is
        affine in its tokens over the run (no measured curves, one side of the overlap's max
        throughout), else from :meth:`decode`; ``tests/test_streaming.py`` holds the two equal
        (the engine's hot path: one call per run of decode steps)."""
        form = self._forms.get(B, 0)
        if form == 0:
            form = self._forms[B] = self._form(B)
        if form is not None and T0 > 0:
            g0, g1, x0, x1, gpu_side, link_side, head = form
            if link_side is None:  # no overlap: one form throughout
                s0, s1 = gpu_side
            else:
                T1 = T0 + B * (k - 1)
                lo, hi = g0 + g1 * T0 - x0 - x1 * T0, g0 + g1 * T1 - x0 - x1 * T1
                if lo * hi < 0:
                    form = None  # the max changes sides within the run
                else:
                    s0, s1 = gpu_side if lo + hi >= 0 else link_side
        else:
            form = None
        launched = False  # the host's launches set the pace (a floor under each step)
        if form is not None and self.floor > 0:
            if s0 + s1 * (T0 + B * (k - 1)) + head <= self.floor:
                launched = True  # throughout the run
            elif s0 + s1 * T0 + head < self.floor:
                form = None  # for the first steps only
        if form is None:
            steps, gpu, link = self._decode(B, T0, k, held)
            ends = np.cumsum(steps)
            if until < np.inf:
                k = min(k, int(np.searchsorted(ends, until)) + 1)
            if gaps is not None:
                gaps.add_steps(steps[:k], B)
            return k, float(ends[k - 1]), float(gpu[:k].sum()), float(link[:k].sum())
        L = self.model.layers
        u, v = s0 + s1 * T0 + head + self.overhead, s1 * B  # step j takes u + v j
        if launched:
            u, v = self.floor + self.overhead, 0.0
        # step j ends at (j + 1) u + v j (j + 1) / 2; a run that ends before ``until`` is whole,
        # else it ends with the first step that ends at or after it
        if until <= k * u + v * (k - 1) * k / 2:
            if v > 0:
                b = u + v / 2
                disc = b * b + 2 * v * (until - u)
                j = math.ceil((-b + math.sqrt(0.0 if 0.0 > disc else disc)) / v)
            else:
                j = math.ceil(until / u - 1)
            j = 0 if 0 > j else j  # (max and min as conditionals here: no calls)
            while j > 0 and j * u + v * (j - 1) * j / 2 >= until:  # the end of step j - 1
                j -= 1
            while (j + 1) * u + v * j * (j + 1) / 2 < until and j < k:
                j += 1
            k = j + 1 if j + 1 < k else k
        tri = B * k * (k - 1) / 2  # tokens added over the run's steps
        if gaps is not None:
            gaps.add_linear(u, v, k, B)
        gpu = L * (g0 * k + g1 * (T0 * k + tri)) + head * k
        return k, k * u + v * k * (k - 1) / 2, gpu, L * (x0 * k + x1 * (T0 * k + tri))
