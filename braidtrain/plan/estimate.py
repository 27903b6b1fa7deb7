"""One layout's estimate: memory (plan/memory.py) and step time (plan/timing.py) put together;
a pipeline's by running its schedule in time (parallel/pipeline.simulate)."""

from __future__ import annotations

import functools

from braidtrain.parallel import pipeline, placement
from braidtrain.parallel.offload import SLOTS
from braidtrain.plan.memory import (ALLOCATOR_SLACK, CONTEXT_BYTES, GB, HOST_PROCESS, HOST_STATE, NCCL_BYTES,
                                    activation_bytes, bf16_kept, grads_at_peak,
                                    bucket_numels, fp8_params, moe_bytes, moe_layer_bytes, param_counts, rank_state,
                                    ring_bytes, stage_counts)
from braidtrain.plan.space import Candidate, Setup, layout_of
from braidtrain.plan.timing import (busbw_of, collective_s, cp_comm_s, dp_comm_s, ep_comm_s, flops_per_token,
                                    offload_s, tp_comm_s)


def estimate(s: Setup, lay: Candidate) -> dict:
    if lay.pp > 1:
        return estimate_pipeline(s, lay)
    cfg, n, tp, cp = s.cfg, lay.dp * lay.cp, lay.tp, lay.cp  # n: the replicas, dp x cp
    counts = param_counts(cfg, tp)
    P = counts["rank"] - counts["expert"] + counts["expert"] // lay.ep  # this tp rank's, then sharded by ZeRO
    buckets = bucket_numels(cfg, s.bucket_mb, tp)
    blocks = [k for kind, k in buckets if kind == "block"]
    embed = sum(k for kind, k in buckets if kind == "embed")  # (gathered all micro-step under ZeRO-3)
    lean = lean_of(s, lay, n, counts["matrices"], counts["expert_matrices"])
    state = rank_state(counts["rank"], counts["expert"], n, lay, max(blocks, default=0), embed, s.live, lean)
    P8 = fp8_params(s, tp, range(1 if lay.recompute else cfg.n_layer))  # (recompute: one block's at a time)
    kept = weights_kept(cfg, tp, P, counts["block"], True, lay.recompute, lean[0] + lean[1] // lay.ep, P8)
    # a rank's t/cp tokens
    act = activation_bytes(cfg, lay.b, s.t // cp, lay.recompute, s.cpu, kept, tp, lay.sp, s.fp8, P8, s.compile)
    if cfg.moe_experts:
        act["moe"] = moe_bytes(s, lay)
        act["peak"] += act["moe"]
    if cp > 1:
        act = {**act, **ring_bytes(s, lay)}
        act["peak"] += act["ring_out"] + act["ring_scores"]
    micro = max(1, s.d // (lay.b * s.t * lay.dp))
    mem = {k: state[k] for k in ("params", "grads", "optimizer")}
    mem["grads"] = grads_at_peak(state, lay.zero, n, micro, act["peak"], embed)
    mem["activations"] = act["peak"]
    allocated = sum(mem.values())
    communicators = (n > 1) + (tp > 1) + (cp > 1 and lay.dp > 1) + (lay.ep > 1) * (1 + (lay.ep < n))  # + ep, expert
    mem["comm"] = 0 if s.cpu else NCCL_BYTES * communicators
    mem["overhead"] = 0 if s.cpu else CONTEXT_BYTES + ALLOCATOR_SLACK * allocated
    mem["total"] = sum(mem.values())

    compute = flops_per_token(s, tp) * s.d / (n * tp * s.tflops * 1e12) * (4 / 3 if lay.recompute else 1)
    fwd = compute / micro * (1 / 4 if lay.recompute else 1 / 3)  # the forward is 1 of 3 (of 4) passes
    bwd = compute / micro - fwd
    # ZeRO-3 gathers the blocks again for the backward where it reads the parameters themselves: fp32
    # (the CPU), --recompute, and a lean state's bf16 buckets (its gathers half the bytes: bf16)
    comm = dp_comm_s(s, lay.zero, n, buckets, micro, fwd, bwd, True, busbw_of(s, lay, "dp"), lean[0] > 0)
    tp_comm = micro * tp_comm_s(s, lay)
    if lay.sp:  # the replicated parameters' partial gradients, this rank's ZeRO share, once a step
        owned = counts["replicated"] / (n if lay.zero >= 1 else 1)
        tp_comm += collective_s(s, "all_gather", 4 * owned * tp, tp, busbw_of(s, lay, "tp"))
    return finish(s, lay, micro, mem, allocated, state, act, compute, comm, tp_comm, cp_comm=micro * cp_comm_s(s, lay),
                  ep_comm=micro * ep_comm_s(s, lay))


def finish(s: Setup, lay, micro, mem, allocated, state, act, compute, dp_comm, tp_comm, pp_comm=0.0, cp_comm=0.0,
           ep_comm=0.0, **more) -> dict:
    comm = dp_comm + tp_comm + pp_comm + cp_comm + ep_comm
    host = offload_s = 0.0
    if lay.offload:  # the optimizer's state leaves the GPU for the host, and its update costs host time
        mem, host, offload_s = offloaded(s, lay, mem, state)
        allocated += mem["optimizer"] - state["optimizer"]  # (what stays on the GPU: the slot the weights come up by)
    step = compute + comm + offload_s
    return {"layout": lay, "micro_steps": micro, "mem": mem, "allocated": allocated, "state": state,
            "activations": act, "compute_s": compute, "dp_comm_s": dp_comm, "tp_comm_s": tp_comm, "pp_comm_s": pp_comm,
            "cp_comm_s": cp_comm, "ep_comm_s": ep_comm, "comm_s": comm, "step_s": step, "tokens_per_s": s.d / step,
            "host": host, "offload_s": offload_s,
            "gpu_fits": mem["total"] <= s.mem_gb * GB,
            "fits": mem["total"] <= s.mem_gb * GB and host <= s.host_gb * GB, **more}


def offloaded(s: Setup, lay, mem: dict, state: dict) -> tuple[dict, float, float]:
    """--offload optimizer: the GPU's memory less the optimizer's state but one fp32 slot as wide as
    the widest owned shard of the blocks' (bf16) buckets, through which their weights come up
    (parallel/offload.py); the host's bytes a node (HOST_STATE a owned element, and SLOTS fp32
    staging buffers as wide as the widest owned shard -- an untied head's or the embedding's
    bucket, for Llama -- and on a GPU the process's own HOST_PROCESS, per rank of the node); the
    step's added seconds: the copies' and the host update's (plan/timing.offload_s). --offload-ratio
    R: only R of the owned elements are hosted, and counted so (host bytes, copies, update); the
    kept buckets' fp32 master and moments, 1 - R of the optimizer's state, stay on the GPU."""
    owned = lay.ratio * (state["optimizer"] - state["master"]) / 8  # elements whose m and v the host holds
    ranks = min(s.gpus, s.gpus_per_node or s.gpus)
    widths = bucket_numels(s.cfg, s.bucket_mb, lay.tp)  # (a pipeline's: the whole model's)
    shards = lay.dp * lay.cp if lay.zero else 1
    widest = -(-max(k for _, k in widths) // shards)
    host = ranks * (HOST_STATE * owned + 4 * min(SLOTS, len(widths)) * widest + (0 if s.cpu else HOST_PROCESS))
    # the device slot: as wide as the widest block (bf16) shard; on the CPU the copy rounds: no slot
    narrow = -(-max((k for kind, k in widths if kind == "block"), default=0) // shards)
    mem = {**mem, "optimizer": (1 - lay.ratio) * state["optimizer"] + (0 if s.cpu else 4 * narrow)}
    held = mem["params"] + mem["grads"] + mem["activations"]
    mem["overhead"] = 0 if s.cpu else CONTEXT_BYTES + ALLOCATOR_SLACK * held
    mem["total"] = sum(v for k, v in mem.items() if k != "total")
    return mem, host, offload_s(owned, ranks)["exposed"]


def lean_of(s: Setup, lay: Candidate, n: int, matrices: int, expert_matrices: int) -> tuple[int, int]:
    """(dense, expert) block matrices in a lean state's bf16 (parallel/buckets.py): a GPU run's (bf16)
    where the fp32 master need not be whole on the GPU -- ZeRO 1-3 over more than one rank (the experts'
    over n / ep), or --offload optimizer."""
    sharded = lambda ranks: not s.cpu and (lay.offload or (lay.zero >= 1 and ranks > 1))
    return (matrices if sharded(n) else 0, expert_matrices if sharded(n // lay.ep) else 0)


def weights_kept(cfg, tp: int, P: int, block: int, head: bool, recompute: bool, lean: int, P8: int) -> int:
    """The parameters whose autocast copies live from a forward to its backward (activation_bytes'
    weights_bf16 counts 2 bytes each, P8 of them float8's 1): all P, or under --recompute one block's
    and the head's (bf16_kept); a lean state (`lean` bf16 matrices) keeps only the fp32 head's bf16
    copy, and --fp8's float8 copies of the matrices (P8)."""
    if lean:
        return bf16_kept(cfg, tp, P, block, head, lean) + P8
    return bf16_kept(cfg, tp, P, block, head) if recompute else P


SIM_MICRO = 2  # pipeline cycles simulated before the step is extrapolated (estimate_pipeline)


def estimate_pipeline(s: Setup, lay: Candidate) -> dict:
    """A pipeline's step and memory from its schedule run in time (pipeline.simulate) with each
    chunk's costs: F a third of the chunk's training FLOPs (its blocks, the head on the last;
    pipeline.flop_cost) at --tflops over tp*cp ranks, B two thirds (zb: B and W a third each; +F
    under recompute), a transfer of the fp32 activations (b*(t/cp)*h*4 bytes, /tp under sp)
    alpha + bytes/busbw. Per rank: its chunks' parameters (placement.for_rank: a last stage's
    copy of wte too; its experts 1/ep) and their ZeRO state over the dp*cp replicas; activations
    = the peak of what the simulation keeps alive (per micro-batch and block the pp = 1 counts at
    t/cp tokens, with the ring's output and an MoE layer's extra; the last chunk's head and
    logits) + the bf16 weights + one rebuilt block under recompute + a ring tile; dp collectives
    after the rank's last backward (step = the latest rank's end + its exposed dp time); tp's,
    cp's and ep's on the busiest rank's critical path, in proportion to its blocks (MoE layers);
    and the tied embedding's exchange between the first and last stage. The
    table's memory is the fullest rank's. Past warm-up the step grows linearly in m: it is
    simulated at two lengths and extrapolated."""
    cfg, n, tp, pp, cp = s.cfg, lay.dp * lay.cp, lay.tp, lay.pp, lay.cp  # n: the replicas, dp x cp
    L = layout_of(s, lay, s.d)
    split, m, chunks = L.split, L.batch.micro_steps, len(L.split)
    t = s.t // cp  # a rank's tokens of each sequence
    terms = activation_bytes(cfg, lay.b, t, lay.recompute, s.cpu, 0, tp, lay.sp, s.fp8,
                             compiled=s.compile)  # pp = 1's, per micro-batch
    per_block = terms["layers"] / cfg.n_layer
    ring = ring_bytes(s, lay) if cp > 1 else {"ring_out": 0, "ring_scores": 0}
    one_ring = ring["ring_out"] / (1 if lay.recompute else cfg.n_layer)  # one block's
    moe = moe_layer_bytes(s, lay) if cfg.moe_experts else 0
    kept = lambda i: per_block + (0 if lay.recompute else one_ring + moe * cfg.is_moe(i))
    size = lambda c: sum(map(kept, split[c])) + (terms["head"] + terms["logits"] if c == chunks - 1 else 0)
    flops = pipeline.flop_cost(cfg, s.t, chunks)
    whole = sum(flops(c, r) for c, r in enumerate(split))
    micro_s = flops_per_token(s, tp) * lay.b * s.t / (tp * cp * s.tflops * 1e12)  # one micro-batch, the whole model
    f = [flops(c, r) / whole * micro_s / 3 for c, r in enumerate(split)]
    b = [x * (1 if lay.schedule == "zb" else 2) + (x if lay.recompute else 0) for x in f]
    cost = {"F": f, "B": b, "W": f}
    hop = s.alpha_us * 1e-6 + 4 * lay.b * t * cfg.n_embd / (tp if lay.sp else 1) / (busbw_of(s, lay, "pp") * 1e9)
    ranks = simulated(lay.schedule, pp, L.virtual, m, tuple(map(tuple, cost.values())), hop,
                      tuple(size(c) for c in range(chunks)))
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.n_layer)) or 1
    rows = []
    for r, sim in enumerate(ranks):
        P, experts, replicated, buckets, lean = stage_counts(cfg, split, pp, r, tp, s.bucket_mb)
        lean = lean_of(s, lay, n, *lean)
        blocks = [k for kind, k in buckets if kind == "block"]
        state = rank_state(P, experts, n, lay, max(blocks, default=0), sum(k for kind, k in buckets if kind != "block"),
                           s.live, lean)
        if lay.schedule == "zb" and lay.zero == 2:  # W opens every block bucket's scratch at once (engine.py)
            extra = 4 * max(0, sum(blocks) - 2 * max(blocks, default=0))
            state = {**state, "grads": state["grads"] + extra, "transient": state["transient"] + extra}
        mine = range(r, chunks, pp)
        held = [i for c in mine for i in split[c]]
        rebuilt = terms["block_recomputed"] + (one_ring + moe * any(map(cfg.is_moe, held)) if lay.recompute else 0)
        held_p = P - experts + experts // lay.ep
        P8 = fp8_params(s, tp, held[:1] if lay.recompute else held)
        kept = weights_kept(cfg, tp, held_p, param_counts(cfg, tp)["block"], chunks - 1 in mine, lay.recompute,
                            lean[0] + lean[1] // lay.ep, P8)
        act = {"live": sim["peak"], "block_recomputed": rebuilt, "ring_scores": ring["ring_scores"],
               "weights_bf16": (0 if s.cpu else 2 * (kept - P8)) + P8}
        act["peak"] = sum(act.values())
        mem = {k: state[k] for k in ("params", "grads", "optimizer")}
        mem["activations"] = act["peak"]
        allocated = sum(mem.values())
        neighbours = 1 if pp == 2 else 2 if 0 < r < pp - 1 or L.virtual > 1 else 1  # (the interleaved ring)
        communicators = ((n > 1) + (tp > 1) + (cp > 1 and lay.dp > 1) + (lay.ep > 1) * (1 + (lay.ep < n))
                         + 1 + 2 * neighbours)  # dp, tp, cp, ep and expert, pp, each direction to each neighbour
        mem["comm"] = 0 if s.cpu else NCCL_BYTES * communicators
        mem["overhead"] = 0 if s.cpu else CONTEXT_BYTES + ALLOCATOR_SLACK * allocated
        mem["total"] = sum(mem.values())
        dp = dp_comm_s(s, lay.zero, n, buckets, m, sum(f[c] for c in mine), sum(b[c] for c in mine), False,
                       busbw_of(s, lay, "dp"), lean[0] > 0)
        rows.append({"mem": mem, "allocated": allocated, "state": state, "act": act, "end": sim["end"] + dp,
                     "blocks": len(held), "moe": sum(map(cfg.is_moe, held)),
                     "bubble": max(0.0, 1 - sim["busy"] / sim["end"]), "replicated": replicated})
    span = max(sim["end"] for sim in ranks)
    step_end = max(row["end"] for row in rows)
    busiest = max(row["blocks"] for row in rows) / cfg.n_layer  # tp's and cp's messages are on its critical path
    tp_comm = m * tp_comm_s(s, lay) * busiest
    if lay.sp:
        owned = max(row["replicated"] for row in rows) / (n if lay.zero >= 1 else 1)
        tp_comm += collective_s(s, "all_gather", 4 * owned * tp, tp, busbw_of(s, lay, "tp"))
    wte = sum(e.local_numel(tp) for e in placement.for_config(cfg) if e.users) / (n if lay.zero >= 1 else 1)
    # first and last stage swap their reduced shares
    tied = (s.alpha_us * 1e-6 + 4 * wte / (busbw_of(s, lay, "pp") * 1e9)) if wte else 0.0
    full = max(rows, key=lambda row: row["mem"]["total"])
    return finish(s, lay, m, full["mem"], full["allocated"], full["state"], full["act"], span, step_end - span,
                  tp_comm, tied, cp_comm=m * cp_comm_s(s, lay) * busiest,
                  ep_comm=m * ep_comm_s(s, lay) * max(row["moe"] for row in rows) / n_moe,
                  bubble=[row["bubble"] for row in rows], stages_gb=[row["mem"]["total"] / GB for row in rows],
                  stage_state=[row["state"] for row in rows])


@functools.lru_cache(maxsize=4096)
def simulated(name: str, pp: int, v: int, m: int, cost: tuple, hop: float, size: tuple) -> list[dict]:
    """pipeline.simulate of the schedule with per-chunk costs (F, B, W) and sizes; past SIM_MICRO
    cycles of pp micro-batches, simulated at two lengths and extrapolated linearly in m (after
    the warm-up each cycle adds the same time, and the same activations -- none but gpipe's)."""
    run = lambda k: pipeline.simulate(pipeline.build(name, pp, v, k), pp,
                                      lambda a: cost["FBW".index(a.op)][a.stage], hop, lambda c: size[c])
    lo = SIM_MICRO * pp * v
    if m <= lo + pp:
        return run(m)
    short, long_ = run(lo), run(lo + pp)
    k = (m - lo) / pp
    return [{key: a[key] + k * (z[key] - a[key]) for key in a} for a, z in zip(short, long_)]
