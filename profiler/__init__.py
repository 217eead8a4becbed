"""The real-hardware profiler (``kvsim profile``): it only measures. Its check, ``kvsim validate``,
lives beside the simulator it checks (:mod:`kvsim.validate`).

Profile a GPU (CUDA events for times, NVML sampled in a background thread)::

    kvsim profile --gpu 0 --model qwen3-4b --out traces/h200-qwen3-4b.npz    # ~2-4 min
    kvsim validate --gpu 0 --profile traces/h200-qwen3-4b.npz                 # MAPE
    kvsim replay --trace traces/h200-qwen3-4b.npz --policy dense-offload ...  # uses it

or the CPU (``--device cpu``: a single-threaded memcpy between two buffers is the "link", one
core computes, timings by perf_counter with the thread's wait for a core taken out)::

    kvsim profile --device cpu --quick --out cpu.npz
    kvsim validate --device cpu --profile cpu.npz

What the hardware section holds (all times are medians after warm-up; sizes rotate over a
working set larger than the last-level cache, as each layer of a real step has its own data):

* ``link_{h2d,d2h}_{pinned,pageable}`` (bytes, seconds): one copy of that many bytes, 4 KiB to
  1 GiB; ``link_bidir_pinned``: both directions at once (bytes per direction);
  ``link_copy_latency``: back-to-back 4 KiB copies (the per-copy cost alpha);
* ``link_gather_gpu`` (bytes, row_bytes, rows, seconds): a device gather of scattered KV rows
  (one token of one KV head of the profiled model) from pinned host memory;
  ``link_gather_gpu_rows`` the same for 256 B..2 KiB rows; ``link_gather_pack``: pack on the
  host, then one copy (with pack and copy times);
* ``kernel_decode_attn`` (context, batch, tokens, seconds): one layer's decode attention for the
  model's head shape, ``tokens = batch x context``; ``kernel_gemm`` (batch, seconds): one layer's
  projections and gated MLP; ``kernel_lm_head``; ``kernel_decide_<policy>`` (context, batch,
  seconds, fetched_frac), one table per policy that decides per step what to fetch: its decide
  step for one layer, ``seconds`` for ONE call that decides the whole batch of ``batch``
  requests (their layers stacked along the head axis: ``batch x kv_heads`` KV heads, ``batch x
  q_heads`` query heads, as a batched decide runs them), and ``fetched_frac`` the mean share of
  the context it fetched per KV head; a grid of contexts x batches (GPU: 4K..32K x 1, 2, 4, 8,
  ``--quick`` 4K, 16K x 1, 2, 4; CPU: 4K..16K x 1, 2, 4, ``--quick`` 4K, 8K x 1, 2). The caller
  hands the kernels in (``kvsim profile`` gives every registered policy's ``decide_kernel``, or
  those of ``--policies``; VerKV's ``stack(B)`` adds B - 1 synthetic requests generated once per
  context, in worker processes when large). Profiles made before the tables were kept per
  policy hold one ``kernel_decide`` table, VerKV's, and are read as such;
  ``kernel_matmul``, ``mem_gemv``, ``mem_copy``: throughput and bandwidth references;
* ``nvml`` (t, sweep, one column per supported field): link generation/width, PCIe rx/tx,
  clocks, power, memory, temperature, utilisation; unsupported fields are listed in ``missing``.

``extra`` holds ``hbm_bytes``, ``hbm_bw`` (bytes/s the LM head streams at batch 1), ``flops``
(best square matmul), alpha/beta fits of every link table (``fit``), the model shape and dtype,
and every sweep a lack of memory cut short (``shrunk``). The simulator reads
``link_h2d_pinned``, ``link_d2h_pinned``, ``link_gather_gpu``, ``kernel_decode_attn``,
``kernel_gemm``, every ``kernel_decide_<policy>`` and those three extras (``kvsim.hw.costs``).

``kvsim profile`` prints each decide table (context x batch -> ms per layer) after the run.
``profiler/gpu_session.sh`` runs profile + validate + the CUDA tests on a GPU machine in one
session (see its header; ``DRY_RUN=1`` runs its plumbing on the CPU).

``kvsim validate`` runs real decode steps (see :mod:`kvsim.validate`) and prints, per
configuration, the measured TPOT (median wall time of a step), the simulator's TPOT from the
profile and the error, then the MAPE. On a shared CPU it also reports the error with the
main thread's wait for a core removed (``mape_excl_wait``).
"""
