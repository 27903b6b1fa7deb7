"""A layout's step time: compute at an achieved FLOP rate (float8 products at their measured
speed-up), and each axis's collectives in an alpha-beta model, counted where they cannot hide
behind compute. docs/planner.md describes the model."""

from __future__ import annotations

import math

from braidtrain.model.counts import counts
from braidtrain.plan.memory import moe_rows
from braidtrain.plan.space import Candidate, Setup

# --offload optimizer, measured on the H200 machine (docs/performance.md, "Optimizer offload",
# 2026-12-03): pinned copies between the GPU and the host, GB/s, device to host (the gradients) and host
# to device (the weights) -- offload_probe.py's 55.1 and 55.2 (PCIe Gen5 x16); and the host's update,
# parameters a second on a node: llama3.2-3b's run at 7634611, 3.21e9 elements in 0.96 s on 16 cores
# (the decay inside the fused kernel, the bf16 rounding on the GPU: docs/performance.md; the fused
# AdamW alone ran 4.1e9 in the probe, the 8B run's old worker 1.84e9)
PCIE_D2H_GBPS = 55.1
PCIE_H2D_GBPS = 55.2
HOST_ADAM_PPS = 3.35e9
OFFLOAD_GRAD_BYTES = OFFLOAD_WEIGHT_BYTES = 4  # an owned element's fp32 gradient down, its weight up (offload.py)
TP_LOW, TP_HIGH = 2, 4  # tp message bytes per element: bf16 matmul outputs; fp32 LayerNorm outputs, embeddings
# --fp8: torch._scaled_mm (e4m3) over bf16's matmul, the forward product of M = 16384 tokens on an
# H200, at the smallest and the largest shape measured: ((K * N, speed-up), ...) (docs/performance.md)
FP8_SPEEDUP = {"tensorwise": ((768 * 3072, 1.54), (8192 * 8192, 1.88)),
               "rowwise": ((768 * 3072, 1.30), (8192 * 8192, 1.84))}


def offload_s(owned: float, ranks: int) -> dict:
    """--offload optimizer's seconds a step on one rank of `owned` elements, `ranks` GPUs of the node
    sharing its cores: `down` the gradients to the host and `up` the updated weights back, on one
    copy stream (parallel/offload.py), so one after the other; `update` the host's AdamW, at
    HOST_ADAM_PPS a node over its ranks. The two run bucket by bucket side by side, so the step
    waits for the slower (`exposed`: the update waits for the gradient norm, the next forward for
    the weights -- nothing of it hides behind the GPU's compute)."""
    down = OFFLOAD_GRAD_BYTES * owned / (PCIE_D2H_GBPS * 1e9)
    up = OFFLOAD_WEIGHT_BYTES * owned / (PCIE_H2D_GBPS * 1e9)
    update = owned * ranks / HOST_ADAM_PPS
    return {"down": down, "up": up, "update": update, "exposed": max(down + up, update)}


def tp_messages(cfg, b: int, t: int, sp: bool, cpu: bool = False) -> dict:
    """The tp group's collectives of one micro-step, (kind, bytes) each (docs/planner.md's list):
    `layer_fwd` and `layer_bwd` per block, `ends` those of the embedding, head and loss."""
    x = b * t * cfg.n_embd
    lo, hi = (4, 4) if cpu else (TP_LOW, TP_HIGH)  # no bf16 on the CPU
    if sp:
        layer_fwd = [("all_gather", hi * x), ("reduce_scatter", lo * x)] * 2  # attention, MLP
        layer_bwd = [("reduce_scatter", hi * x), ("all_gather", lo * x)] * 2
        ends = [("reduce_scatter", 4 * x), ("all_gather", 4 * x),  # forward: embedding, head input
                ("reduce_scatter", 4 * x), ("all_gather", 4 * x)]  # backward: head input, embedding
    else:
        layer_fwd = [("all_reduce", lo * x)] * 2
        layer_bwd = [("all_reduce", hi * x)] * 2
        ends = [("all_reduce", 4 * x), ("all_reduce", 4 * x)]  # embedding forward, head input backward
    ends += [("all_reduce", 4 * b * t), ("all_reduce", 8 * b * t)]  # the loss: max, (sum of exp, target)
    return {"layer_fwd": layer_fwd, "layer_bwd": layer_bwd, "ends": ends}


def fp8_speedup(recipe: str, k: int, n: int) -> float:
    """A float8 product's speed over bf16's for a (K in, N out) weight: FP8_SPEEDUP interpolated in
    log(K * N) between the shapes measured, held at the nearer one beyond them."""
    (lo, r_lo), (hi, r_hi) = FP8_SPEEDUP[recipe]
    f = min(1.0, max(0.0, math.log(k * n / lo) / math.log(hi / lo)))
    return r_lo + f * (r_hi - r_lo)


def flops_per_token(s: Setup, tp: int = 1) -> float:
    """Training FLOPs per token at bf16's rate: the model's, with each block linear's 6 * K * N under
    --fp8 counted 1/fp8_speedup of itself, at its shape on a tp rank."""
    total = s.cfg.flops_per_token(s.t)
    if s.fp8:
        for n, k, dim in (w for block in counts(s.cfg)["linear"] for w in block):
            local = (k, n // tp) if dim == 0 else (k // tp, n)  # column-parallel splits the outputs, row the inputs
            total -= 6 * n * k * (1 - 1 / fp8_speedup(s.fp8, *local))
    return total


def busbw_of(s: Setup, lay: Candidate, axis: str) -> float:
    """GB/s of one axis group's collectives: --busbw inside a node (--tp-busbw for tp),
    --node-busbw once the group spans nodes. The mesh is pp, dp, cp, tp outer to inner (mesh.py),
    so a group spans a run of consecutive ranks: a tp group tp of them, a cp group cp*tp, the
    replicas dp*cp*tp, an ep run ep*cp*tp (runs of the replicas in their cp-major tree order);
    a pipeline's hops are counted as crossing nodes once the world does."""
    span = {"tp": lay.tp, "cp": lay.cp * lay.tp, "dp": lay.dp * lay.cp * lay.tp, "ep": lay.ep * lay.cp * lay.tp,
            "pp": lay.gpus}[axis]
    if span > (s.gpus_per_node or s.gpus):
        return s.node_busbw
    return (s.tp_busbw or s.busbw) if axis == "tp" else s.busbw


def collective_s(s: Setup, kind: str, nbytes: float, n: int, busbw: float | None = None) -> float:
    if n == 1:
        return 0.0
    k = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return s.alpha_us * 1e-6 + k * nbytes / ((busbw or s.busbw) * 1e9)


def exposed(times: list[float], window: float) -> float:
    """Messages issued while `window` seconds of compute run: one of them cannot hide (the last
    reduction after the backward ends, or the first gather before the forward starts); the rest
    hide behind compute, up to the length of the window."""
    return times[-1] + max(0.0, sum(times[:-1]) - window) if times else 0.0


def tp_comm_s(s: Setup, lay: Candidate) -> float:
    """Seconds of tp communication in one micro-step, all of it on the critical path: a layer
    cannot go on before its all-reduce (or all-gather) is back."""
    if lay.tp == 1:
        return 0.0
    m = tp_messages(s.cfg, lay.b, s.t // lay.cp, lay.sp, s.cpu)  # a rank's t/cp tokens under cp
    bw = busbw_of(s, lay, "tp")
    t = lambda msgs: sum(collective_s(s, kind, nb, lay.tp, bw) for kind, nb in msgs)
    passes = 2 if lay.recompute else 1  # recompute runs each block's forward (and its messages) again
    return s.cfg.n_layer * (passes * t(m["layer_fwd"]) + t(m["layer_bwd"])) + t(m["ends"])


def dp_comm_s(s: Setup, zero: int, n: int, buckets: list, micro: int, fwd: float, bwd: float, again: bool,
              busbw: float, lean: bool = False) -> float:
    """Exposed seconds of a rank's data-parallel collectives in a step: its buckets (in launch
    order) reduced (fp32), and gathered (fp32; a lean state's block buckets bf16), as each ZeRO stage
    does (docs/planner.md); fwd, bwd: seconds of a micro-step's forward and backward that they can
    hide behind; again: ZeRO-3 gathers the blocks again for the backward; busbw: the replica group's."""
    msg = [4 * k for _, k in buckets]
    gathered = [(2 if lean and kind == "block" else 4) * k for kind, k in buckets]
    ar, rs = ([collective_s(s, kind, m, n, busbw) for m in msg] for kind in ("all_reduce", "reduce_scatter"))
    ag = [collective_s(s, "all_gather", m, n, busbw) for m in gathered]
    if zero == 0:  # all-reduce on the last micro-step, overlapped with its backward
        return exposed(ar, bwd)
    if zero == 1:  # reduce-scatter likewise; then the updated parameters are all-gathered, exposed
        return exposed(rs, bwd) + sum(ag)
    if zero == 2:  # no full gradient buffer: reduce-scatter on every micro-step
        return micro * exposed(rs, bwd) + sum(ag)
    # each block bucket is gathered before its forward, prefetched one bucket ahead, so mostly only
    # the first gather (the embedding group, held all micro-step) and the last reduce-scatter are
    # exposed; reduce-scatter every micro-step
    return micro * (exposed(ag, fwd) + exposed((ag[:-1] if again else []) + rs, bwd))


def ep_comm_s(s: Setup, lay: Candidate) -> float:
    """Seconds of the experts' all-to-alls in one micro-step, all exposed (the next layer waits for
    them): per MoE layer the rows there and back in the forward (bf16; fp32 on the CPU), their
    gradients back and there in the backward -- 4 all-to-alls of (ep-1)/ep of the rows -- plus the
    counts' (latency only); the forward's again under recompute."""
    if lay.ep == 1:
        return 0.0
    cfg = s.cfg
    rows = moe_rows(s, lay) * cfg.n_embd * (4 if s.cpu else 2)
    one = collective_s(s, "all_to_all", rows, lay.ep, busbw_of(s, lay, "ep")) + s.alpha_us * 1e-6
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.n_layer))
    return n_moe * one * (2 * (2 if lay.recompute else 1) + 2)


def cp_comm_s(s: Setup, lay: Candidate) -> float:
    """Exposed seconds of context parallelism's transfers in one micro-step (parallel/context.py).
    The ring: per block, cp - 1 forward steps each send this rank's keys and values (2 b t/cp C,
    bf16; fp32 on the CPU) while two block pairs are attended to (4 b c^2 C FLOPs each way,
    c = t/2cp), only what outlasts them exposed; the backward sends them again the same way and
    the fp32 dK, dV after each of its cp steps, unhidden. All-gather: per block one all-gather of
    every rank's keys and values before any attention (forward and backward) and one
    reduce-scatter of their fp32 gradients after it, none hidden but each paying one latency, not
    cp - 1 -- so it wins where the ring's hops are short and latency-bound (short sequences, many
    cp ranks) and the ring wins where attention hides its transfers (long ones). tp shares the heads."""
    if lay.cp == 1:
        return 0.0
    cp, C, b = lay.cp, s.cfg.n_embd / lay.tp, lay.b
    c = s.t / (2 * cp)
    kv = 2 * b * (s.t / cp) * s.cfg.kv_heads * s.cfg.head_dim / lay.tp * (4 if s.cpu else 2)  # (grouped-query: K heads)
    dkv = kv * (1 if s.cpu else 2)  # fp32
    passes, bw = 2 if lay.recompute else 1, busbw_of(s, lay, "cp")
    if lay.cp_impl == "allgather":
        gather = collective_s(s, "all_gather", kv * cp, cp, bw)
        return s.cfg.n_layer * (passes * gather + gather + collective_s(s, "reduce_scatter", dkv * cp, cp, bw))
    hop = lambda nbytes: s.alpha_us * 1e-6 + nbytes / (bw * 1e9)
    pairs_s = 2 * 4 * b * c * c * C / (s.tflops * 1e12)  # a ring step's attention, forward
    fwd = (cp - 1) * max(0.0, hop(kv) - pairs_s)
    bwd = (cp - 1) * max(0.0, hop(kv) - 2 * pairs_s) + cp * hop(dkv)
    return s.cfg.n_layer * (passes * fwd + bwd)
