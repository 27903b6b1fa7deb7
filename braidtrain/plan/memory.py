"""Per-GPU memory of a layout: model state by ZeRO stage, activations by term, buckets and
parameters from the placement table, the experts' and the ring's extra. Every number the estimates
rest on is named once below; docs/planner.md derives them."""

from __future__ import annotations

import functools

from braidtrain.model.counts import block_activations, counts, moe_activations
from braidtrain.parallel import buckets, placement
from braidtrain.parallel.context import tile_rows
from braidtrain.plan.space import Candidate, Setup

# Calibration knobs: every number the estimates rest on, named once (bytes per element).
ACT_KEPT_RECOMPUTE = 4  # per token x channel of one block under recompute: its fp32 input
ACT_HEAD_LN = 4  # per token x channel: ln_f's fp32 input (t/tp rows under sp)
ACT_HEAD_IN = 2  # per token x channel: the head matmul's bf16 input (whole under tp)
LOGITS = 2  # per token x vocab (tp = 1): loss.py's fused head keeps one bf16 logits buffer, which becomes its gradient
LOGITS_TP = 4 + 2  # vocab-parallel, per token x local vocab: fp32 softmax (in place) + bf16 logits / gradient
CONTEXT_BYTES = 1e9  # CUDA context, cuBLAS/cuDNN workspaces: outside torch's allocator
ALLOCATOR_SLACK = 0.05  # fragmentation of the caching allocator, a fraction of what it holds
NCCL_BYTES = 0.5e9  # NCCL's channel buffers per communicator (n > 1), outside torch's allocator
GB = 1e9  # what metrics.jsonl's mem_gb uses
HOST_STATE = 12  # --offload, per element a rank owns: fp32 master + Adam m, v in host memory (parallel/offload.py)
# --offload on a GPU: a rank's own resident memory beside that state (torch, CUDA's host side, the compiled
# graphs): the runs' max RSS less the planned state, 8.1 GB at llama3.2-3b and 8.2 at llama3.1-8b on the H200
# (docs/performance.md, "Optimizer offload"); on the CPU the plan counts the state alone (plan --check's figure)
HOST_PROCESS = 8e9


def model_state_bytes(P: int, n: int, zero: int, block_params: int, embed_params: int, live: bool = False,
                      lean: int = 0) -> dict:
    """Per-GPU bytes of parameters, gradients and optimizer state (docs/planner.md's table).
    P: parameters this rank holds before ZeRO (P_tp under tp); block_params: elements of the
    largest block bucket; embed_params: elements of wte + wpe + ln_f (all three this tp rank's).
    lean: how many of the P are a bf16 run's block matrices (parallel/buckets.py's lean state: bf16
    compute weights, 2 bytes, and an fp32 master apart, 4 bytes an owned element, counted with the
    optimizer's m and v as Megatron-LM counts it); 0 in fp32 runs (the bucket is the master).
    `transient` is the part of params + grads that exists only during the forward/backward pass
    (scratch S, working set W; ZeRO-0/1's whole gradient, which exists from the backward to the
    update: parallel/grads.py): a rank at rest, as measured between steps on the CPU, holds the
    rest. A group of one rank runs stage 0's mechanics, whatever the stage (buckets.zero_stage).
    live: live recovery's copy of the next rank's shard at ZeRO 1-3 -- its m and v, the gradient it
    receives, and at ZeRO-3 its parameters (parallel/mirror.py)."""
    zero = zero if n > 1 else 0
    scratch = 4 * (embed_params + 2 * block_params) if zero >= 2 else 0  # S
    working = ((2 if lean else 4) * 2 * block_params + 4 * embed_params) if zero == 3 else 0  # (gathered in bf16)
    copy = live and zero >= 1
    weights = 4 * P - 2 * lean  # the compute weights, whole: fp32, and the lean state's bf16 matrices
    optimizer = 8 * P + 4 * lean  # m, v; the lean state's masters
    return {
        "params": weights // n + copy * (4 * (P - lean) // n) + working if zero == 3 else weights,
        "grads": (4 * P // n + scratch if zero >= 2 else 4 * P) + copy * 4 * P // n,
        "optimizer": (optimizer // n) * (1 + copy) if zero >= 1 else optimizer,
        "transient": scratch + working + (4 * P if zero <= 1 else 0),
        "master": 4 * lean // n if zero >= 1 else 4 * lean,  # (the lean state's masters, in "optimizer")
    }


def grads_at_peak(state: dict, zero: int, n: int, micro: int, activations: float, embed_params: int) -> float:
    """The gradients a rank holds at its peak, the start of the backward. ZeRO-0/1 open a bucket's
    gradient as the backward reaches it (engine.py), while the backward frees the activations: with
    one micro-step, blocks of activations give way to blocks of gradients, so the peak holds the
    larger of the two, and the head's and embedding group's gradients, opened first, beside the
    activations; with more, the gradients live through the later micro-steps' forwards. ZeRO-2/3's
    shards and scratch: as counted."""
    if (zero if n > 1 else 0) >= 2 or micro > 1:
        return state["grads"]
    return max(4 * embed_params, state["grads"] - activations)


def rank_state(P: int, experts: int, n: int, lay: Candidate, block_params: int, embed_params: int,
               live: bool = False, lean: tuple[int, int] = (0, 0)) -> dict:
    """model_state_bytes of a rank that holds P parameters before ep and ZeRO, `experts` of them
    an expert's: those 1/ep of them, sharded over the n/ep replicas holding the same experts.
    lean: (dense, expert) elements of a bf16 run's block matrices among them (param_counts)."""
    state = model_state_bytes(P - experts, n, lay.zero, block_params, embed_params, live, lean[0])
    if experts:
        expert = model_state_bytes(experts // lay.ep, n // lay.ep, lay.zero, 0, 0, live, lean[1] // lay.ep)
        state = {k: state[k] + expert[k] for k in state}
    return state


@functools.lru_cache(maxsize=256)
def param_counts(cfg, tp: int = 1) -> dict:
    """Parameters one tp rank holds, from the placement table (parallel/placement.py):
    `replicated` (gpt2: wpe, ln_f, and per block ln_1, ln_2 and the two c_proj biases; llama: the
    norms) whole, `sharded` (the vocabulary padded to vocab_rows(tp), the projections) divided by tp;
    `block` and `embed` are one block's and the groups of no block's (the embedding, and an untied
    head) share of `rank`, the sum; `matrices` and `expert_matrices` the blocks' 2-D weights (an
    expert's slices), which a bf16 run keeps in bf16 (parallel/buckets.lean)."""
    table = placement.for_config(cfg)
    count = lambda entries: sum(e.local_numel(tp) for e in entries)
    block = next(entries for module, entries in table.units if module is not None)
    embed = [e for module, entries in table.units if module is None for e in entries]
    return {"rank": count(table), "block": count(block), "embed": count(embed),
            "replicated": count(e for e in table if e.replicated),
            "sharded": count(e for e in table if not e.replicated), "expert": count(e for e in table if e.expert),
            **lean_counts(table, tp)}


def lean_counts(table, tp: int) -> dict:
    """The blocks' matrices of a placement table (buckets.lean's bf16 ones), dense and experts'."""
    matrices = [e for module, entries in table.units if module is not None for e in entries if e.decays]
    return {"matrices": sum(e.local_numel(tp) for e in matrices if not e.expert),
            "expert_matrices": sum(e.local_numel(tp) for e in matrices if e.expert)}


@functools.lru_cache(maxsize=256)
def bucket_numels(cfg, bucket_mb: float, tp: int = 1, table=None) -> tuple[tuple[str, int], ...]:
    """The engine's buckets (parallel/buckets.form on the placement table), in launch order, as
    ("block" or "embed", elements): an untied head's group first, then whole blocks from the last
    one backwards until a bucket holds >= bucket_mb, then the embedding group (gpt2: wte, tied to
    the head, wpe, ln_f) alone: it is used at both ends, so its gradient is last. Sizes are one tp
    rank's (its shards and the replicated parameters). `table`: a pipeline rank's
    (placement.for_rank), where a tied embedding is a bucket of its own (parallel/tied.py)."""
    alone = {e.name for e in table if e.users} if table is not None else set()
    formed = buckets.form(table or placement.for_config(cfg), lambda e: e.local_numel(tp), bucket_mb, alone)
    return tuple(("block" if mods else "embed", buckets.place([e.local_numel(tp) for e in entries],
                                                               [e.shape[0] if e.expert else 1 for e in entries])[1])
                 for entries, mods, _, _ in formed)


@functools.lru_cache(maxsize=1024)
def stage_counts(cfg, split: tuple, pp: int, r: int, tp: int, bucket_mb: float) -> tuple:
    """Pipeline rank r's parameters (placement.for_rank), its experts', its replicated ones, its
    buckets, and its blocks' (dense, expert) matrices (cached: each (mesh, split) is weighed at many
    ZeRO stages, b and recompute)."""
    table = placement.for_rank(cfg, split, pp, r)
    count = lambda keep: sum(e.local_numel(tp) for e in table if keep(e))
    lean = lean_counts(table, tp)
    return (count(lambda e: True), count(lambda e: e.expert), count(lambda e: e.replicated),
            bucket_numels(cfg, bucket_mb, tp, table), (lean["matrices"], lean["expert_matrices"]))


def layer_activation(cfg, tp: int = 1, sp: bool = False, cpu: bool = False, fp8: str | None = None,
                     compiled: bool = False) -> float:
    """Bytes per token one block keeps for its backward (docs/planner.md's layers term), traced from
    the family's own block (model/counts.py; its linears in float8 under fp8): the part every tp
    rank holds whole, plus the rest divided by tp. On a GPU outside --fp8 the SwiGLU operator runs
    (build.settle; the planner plans default mode, so an eager --exact run keeps F values a token
    and layer more than planned)."""
    return block_activations(cfg, tp, sp, gpu=not cpu, fp8=fp8, compiled=compiled, fused=not cpu and not fp8)


def activation_bytes(cfg, b: int, t: int, recompute: bool, cpu: bool, P: int, tp: int = 1, sp: bool = False,
                     fp8: str | None = None, P8: int = 0, compiled: bool = False) -> dict:
    """Named terms (docs/planner.md), so each can be calibrated on its own; `peak` is
    what they add up to at the worst moment, the start of the backward pass. P: the parameters
    this rank holds (P_tp) -- under recompute, those whose bf16 copies stay (bf16_kept); P8: those
    of them that --fp8 keeps in float8 instead (fp8_params)."""
    scale = 2 if cpu else 1  # fp32 on the CPU
    tbh = t * b * cfg.n_embd * scale
    rows = tp if sp else 1  # the residual stream holds t/tp rows under sp
    layer = layer_activation(cfg, tp, sp, cpu, fp8, compiled) * b * t
    if tp == 1:
        logits = b * t * cfg.padded_vocab * LOGITS * scale
    else:
        logits = b * t * cfg.vocab_rows(tp) // tp * LOGITS_TP
    terms = {
        "layers": (ACT_KEPT_RECOMPUTE * tbh / rows if recompute else layer) * cfg.n_layer,
        "block_recomputed": layer if recompute else 0,
        "head": ACT_HEAD_LN * tbh / rows + ACT_HEAD_IN * tbh,
        "logits": logits,
        "weights_bf16": (0 if cpu else 2 * (P - P8)) + P8,
    }
    # a block rebuilt by recompute lives after the logits' gradients are gone: the larger counts
    transient = max(terms["logits"], terms["block_recomputed"])
    terms["peak"] = terms["layers"] + terms["head"] + terms["weights_bf16"] + transient
    return terms


def bf16_kept(cfg, tp: int, P: int, block: int, head: bool, lean: int = 0) -> int:
    """Parameters whose bf16 (autocast) copies a rank keeps under --recompute: a block's forward
    keeps nothing for its backward but its input, so its copies go with it and come again one block
    at a time; the head's (the fused loss keeps its weight's) stay. Without recompute, all P. A lean
    state's bf16 matrices (`lean` of them, `block` among them) need no copy: the fp32 head's stays."""
    head = cfg.vocab_rows(tp) // tp * cfg.n_embd if head else 0
    if lean:
        return min(P - lean, head)
    return min(P, block + head)


def fp8_params(s: Setup, tp: int, blocks) -> int:
    """Elements of the blocks' float8 weights (their linears', this tp rank's) under --fp8, else 0."""
    linear = counts(s.cfg)["linear"]
    return sum(n * k for i in blocks for n, k, _ in linear[i]) // tp if s.fp8 else 0


def moe_rows(s: Setup, lay: Candidate) -> float:
    """Rows a rank's experts compute in one MoE layer of a micro-step: k per token, at most the
    capacity (C k per token) with one; the router balanced (dispatch.py's rows arrive evenly)."""
    cfg = s.cfg
    k = cfg.moe_top_k * (min(1.0, cfg.moe_capacity) if cfg.moe_capacity > 0 else 1.0)
    return k * lay.b * s.t / lay.cp / (lay.tp if lay.sp else 1)


def moe_layer_bytes(s: Setup, lay: Candidate) -> float:
    """What one MoE layer adds to a rank's activations beyond the dense MLP's (counted in the
    layers term): its routed rows' and its tokens' bytes, traced from the family's own layers
    (model/counts.py's moe_activations)."""
    per_row, per_token = moe_activations(s.cfg, lay.tp, lay.sp and lay.tp > 1, gpu=not s.cpu)
    return max(0.0, moe_rows(s, lay) * per_row + lay.b * s.t / lay.cp * per_token)


def moe_bytes(s: Setup, lay: Candidate) -> float:
    """A micro-batch's MoE layers' extra activations: every MoE layer's, one under recompute."""
    n_moe = sum(s.cfg.is_moe(i) for i in range(s.cfg.n_layer))
    return moe_layer_bytes(s, lay) * (1 if lay.recompute else n_moe)


def ring_bytes(s: Setup, lay: Candidate) -> dict:
    """What context.py's attention adds to a rank's activations: per block its fp32 output (and
    log-sum-exp), saved for the backward (4 b t/cp C/tp; one block under recompute); and, while a
    block pair is computed, one tile's fp32 scores, probabilities and their gradients (4 x 4 b
    H/tp rows c, context.tile_rows). All-gather adds, for the block in its backward, every rank's
    keys and values (2 b t C/tp) and their fp32 gradients before the reduce-scatter (twice that)."""
    b, h, c = lay.b, s.cfg.n_head // lay.tp, s.t // (2 * lay.cp)
    out = 4 * b * (s.t // lay.cp) * (s.cfg.n_embd // lay.tp + h)
    kv = s.cfg.kv_heads * s.cfg.head_dim // lay.tp  # the key/value channels a rank holds
    gathered = 2 * b * s.t * kv * ((4 if s.cpu else 2) + 4) if lay.cp_impl == "allgather" else 0
    return {"ring_out": out * (1 if lay.recompute else s.cfg.n_layer),
            "ring_scores": 16 * b * h * tile_rows(c) * c + gathered}
