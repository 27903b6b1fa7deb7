"""The planner: per-GPU memory and step time of every layout, ranked (the command, its table and
`--check` against a real run: plan_cli.py).

A candidate is one point of the mesh (dp x tp, with sequence parallelism on or off when tp > 1) x
ZeRO stage x micro-batch b x recompute; layout.make_layout -- the validator `train` runs -- says
which can run. Each axis is one more loop in `meshes` and one more term in `estimate`: pp
(estimate_pipeline, a simulation of the schedule), cp and ep, each with the others.

Topology (--gpus-per-node): the mesh is pp, dp, cp, tp outer to inner, so each axis group is a
run of consecutive ranks; a group that fits in a node talks at --busbw (--tp-busbw for tp), one
that spans nodes at --node-busbw (busbw_of). The ranking then keeps tp, and ep's all-to-all,
inside a node wherever that is faster, with no rule of its own.

Context parallelism (cp ranks share each sequence): the replica group
is the n = dp*cp ranks of a tp slot (ZeRO shards over all of them); a rank's activations are
those of its t/cp tokens (the counts below at t/cp) plus ring_bytes: the ring's fp32 output
per block and one tile's fp32 scores; compute is the same FLOPs over dp*cp*tp ranks, at
--tflops (on a GPU the block pairs are flash's kernels, within 4-22% of flash SDPA at cp = 1;
exact mode's fp32 pairs are 30-50x slower: not modelled); and cp_comm_s adds what of the ring's transfers outlasts the attention it overlaps.

Tensor parallelism (the placement table) splits each tp rank's parameters into a sharded part,
divided by tp -- wte (the vocabulary padded to vocab_rows(tp), a multiple of 128*tp), c_attn,
c_fc, and the weights of both c_proj -- and a replicated part R that every tp rank holds whole:
wpe, the LayerNorms, the c_proj biases (R = block_size*h + 2h + 6h*L). Per tp rank

    P_tp = (vocab_rows(tp)*h + L*(12h^2 + 7h)) / tp + R          (P_1 = P, the count below)

and ZeRO shards P_tp over the replica group, the n = dp ranks of one tp slot, as before.

Model state per GPU (P_tp parameters, n = dp; fp32 master weights and gradients, fp32 Adam m and
v; bf16 autocast on the GPU). `W` is the ZeRO-3 working set in bytes: two block buckets (whole
blocks up to bucket_mb of 2^20 bytes) in fp32 (the one in use and the prefetched one) plus the
embedding group wte + wpe + ln_f, which stays gathered for the whole micro-step because the tied
head uses it again at the end. `S`, ZeRO-2/3's gradient scratch, is as large: the embedding
group's (open from its first gradient, early in the backward, to the end) and two block buckets'
(one filling, one whose reduce-scatter is in flight). Buckets hold this tp rank's shards (block:
(12h^2 + 7h)/tp + 6h; embedding group: vocab_rows(tp)*h/tp + block_size*h + 2h).

    stage    parameters     gradients                optimizer (m, v)   total
    ZeRO-0   4P             4P                       8P                 16P
    ZeRO-1   4P             4P (reduce-scatter in    8P/n               8P + 8P/n
                            place: the shard is a view)
    ZeRO-2   4P             4P/n + S                 8P/n               4P + 12P/n + S
    ZeRO-3   4P/n + W       4P/n + S                 8P/n               16P/n + W + S
                                                                        (P here is P_tp)

Activations per micro-batch (b sequences of t tokens, width h, L layers, padded vocabulary V), on
the GPU under bf16 autocast; with them `--check` on an H200 is within 1% for gpt2 at b = 4 ... 16
(vocabularies 50257 and 256, with and without recompute; tp = 1); at b = 1 it reads ~0.1 GB low:
    layers   38*t*b*h per layer: Korthikanti et al. 2022 (Table 2) count 34, without the
             5*a*t^2*b attention matrix (flash / SDPA never stores it), assume a 16-bit residual
             stream; here it is fp32 (the embeddings are, and autocast leaves additions alone), so
             both LayerNorm inputs are 4 bytes and there are no dropout masks:
             ln_1 in 4, c_attn in 2, q k v 6, attention out 2, c_proj in 2, ln_2 in 4, c_fc in 2,
             GELU in 8, GELU out 8 = 38
             tp, no sp: the 26 inside the tp regions (q k v, attention out, c_proj in, GELU in and
             out) are this rank's heads / MLP columns, divided by tp; the 12 at their edges are
             whole on every rank: both LayerNorm inputs (4 + 4) and the bf16 inputs of c_attn and
             c_fc (2 + 2), which every rank saves for its column-parallel matmul. Table 2's
             10 + 24/tp, here (12 + 26/tp)*t*b*h.
             tp with sp: the LayerNorm inputs hold t/tp rows; but c_attn and c_fc still save the
             bf16 copy of their all-gathered input, the whole sequence (layers.py keeps no
             local-rows-only copy to re-gather in the backward, as Megatron does): (4 + 34/tp)*t*b*h
             (Table 2's 34/tp, had the gathered inputs been re-gathered).
             recompute: 4*t*b*h per layer (the fp32 block input; /tp under sp), plus one block's
             activations (the counts above) while it is rebuilt in the backward, after the logits'
             buffers are gone (the larger counts)
    head     6*t*b*h: ln_f's fp32 input (/tp under sp) and the head matmul's bf16 input (whole
             under tp, with or without sp)
    logits   tp = 1: b*t*V*2: loss.py's fused head keeps one bf16 logits buffer, which its forward
             overwrites in place with the gradient (no fp32 copy, no log-probs)
             tp > 1: b*t*(V_tp/tp)*(4 + 2), V_tp = vocab_rows(tp): the vocab-parallel cross-entropy
             never gathers the logits and works in place: it keeps its fp32 softmax (4), which the
             backward overwrites with the gradient; next to it the forward's bf16 logits, then the
             backward's bf16 copy of the gradient (2)
    weights  2*P_tp: autocast's bf16 copies of the weights, cached for the forward and saved for
             the backward (also under ZeRO-3: releasing a gathered fp32 bucket does not free them)
On the CPU (fp32, no autocast) the per token x channel terms count twice and there are no bf16 copies.
Measured for tp on one H200 (2026-11-29, torch 2.11), through the tp code path with a one-rank group
(gpt2, b = 8, with and without sp and recompute): the vocab-parallel cross-entropy peaked 2.472 GB
below torch's dense cross-entropy, used before loss.py (its terms then: 2.473), and the tp collectives come in the dtypes and numbers
listed below; the division by tp itself awaits a machine of two or more GPUs.

FP8 (--fp8): the blocks' linears keep float8 copies (1 byte an element) of their inputs and
weights for the backward in place of bf16 ones (the layers term, traced through model/fp8.py; the
weights term: 1 byte a linear weight element instead of 2), and their three products run at
FP8_SPEEDUP's ratio over bf16's (flops_per_token). The casts around them (amax, scale, cast:
memory-bound, fused into neighbouring kernels under --compile) are not counted.

Per GPU: allocated = parameters + gradients + optimizer + activations (what
torch.cuda.max_memory_allocated sees); total = allocated + communication buffers (NCCL's own per
communicator -- the replica group's if dp > 1, the tp group's if tp > 1 -- outside torch's
allocator) + overhead (CUDA context and workspaces, plus allocator slack).

Step time = compute + exposed communication. Compute = flops_per_token(t) * d / (dp * tp *
achieved FLOP/s), x 4/3 with recompute (a second forward); under --fp8 a block linear's FLOPs count
1/FP8_SPEEDUP of themselves. Collectives follow an alpha-beta model
per message: alpha + k * bytes / busbw, k = 2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter and
all-gather, bytes the whole (reduced or gathered) tensor (the bus-bandwidth convention of
nccl-tests). dp: the gradient buckets (this tp rank's shards, 4*P_tp bytes in all) over the replica
group at --busbw, overlapped with the backward as each stage allows (see `estimate`). tp, at
--tp-busbw (default --busbw: a tp group is consecutive ranks, one node's NVLink), every message on
the critical path, per micro-step with x = b*t*h:
    per layer, no sp  forward: 2 all-reduces of the row-parallel outputs, bf16 (2x bytes each);
                      backward: 2 all-reduces of the column-parallel input gradients, fp32 (4x:
                      the LayerNorm outputs are fp32, so are their gradients)
    per layer, sp     forward: 2 all-gathers of the LayerNorm outputs (fp32, 4x) + 2
                      reduce-scatters of the row-parallel outputs (bf16, 2x); backward: the
                      transposes, 2 reduce-scatters (4x) + 2 all-gathers (2x). With and without sp
                      a layer moves the same bus volume, 24x(tp-1)/tp bytes
    recompute         the layers' forward messages once more (the rebuilt forward)
    ends              fp32 (4x): the embedding's forward all-reduce (sp: reduce-scatter forward,
                      all-gather backward) and the head input's backward all-reduce (sp:
                      all-gather forward, reduce-scatter backward); the cross-entropy's two
                      all-reduces of 1 and 2 floats per token
    once a step, sp   the replicated parameters' partial gradients (this rank's ZeRO share of R),
                      all-gathered over tp and summed
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from braidtrain.config import Config
from braidtrain.errors import UserError
from braidtrain.layout import make_layout
from braidtrain.parallel import pipeline

# Calibration knobs: every number the estimates rest on, named once (bytes per element).
ACT_KEPT_RECOMPUTE = 4  # per token x channel of one block under recompute: its fp32 input
ACT_HEAD_LN = 4  # per token x channel: ln_f's fp32 input (t/tp rows under sp)
ACT_HEAD_IN = 2  # per token x channel: the head matmul's bf16 input (whole under tp)
LOGITS = 2  # per token x vocab (tp = 1): loss.py's fused head keeps one bf16 logits buffer, which becomes its gradient
LOGITS_TP = 4 + 2  # vocab-parallel, per token x local vocab: fp32 softmax (in place) + bf16 logits / gradient
TP_LOW, TP_HIGH = 2, 4  # tp message bytes per element: bf16 matmul outputs; fp32 LayerNorm outputs, embeddings
CONTEXT_BYTES = 1e9  # CUDA context, cuBLAS/cuDNN workspaces: outside torch's allocator
ALLOCATOR_SLACK = 0.05  # fragmentation of the caching allocator, a fraction of what it holds
NCCL_BYTES = 0.5e9  # NCCL's channel buffers per communicator (n > 1), outside torch's allocator
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
# --fp8: torch._scaled_mm (e4m3) over bf16's matmul on one H200 (torch 2.11, M = 16384 tokens, the
# forward product), at the smallest and the largest shape measured: ((K * N, speed-up), ...)
FP8_SPEEDUP = {"tensorwise": ((768 * 3072, 1.54), (8192 * 8192, 1.88)),
               "rowwise": ((768 * 3072, 1.30), (8192 * 8192, 1.84))}
GB = 1e9  # what metrics.jsonl's mem_gb uses


def model_state_bytes(P: int, n: int, zero: int, block_params: int, embed_params: int) -> dict:
    """Per-GPU bytes of parameters, gradients and optimizer state (the table above).
    P: parameters this rank holds before ZeRO (P_tp under tp); block_params: elements of the
    largest block bucket; embed_params: elements of wte + wpe + ln_f (all three this tp rank's).
    `transient` is the part of params + grads that exists only during the forward/backward pass
    (scratch S, working set W): a rank at rest, as measured between steps on the CPU, holds the
    rest. A group of one rank runs stage 0's mechanics, whatever the stage (buckets.zero_stage)."""
    zero = zero if n > 1 else 0
    scratch = 4 * (embed_params + 2 * block_params) if zero >= 2 else 0  # S
    working = 4 * (2 * block_params + embed_params) if zero == 3 else 0
    return {
        "params": 4 * P // n + working if zero == 3 else 4 * P,
        "grads": 4 * P // n + scratch if zero >= 2 else 4 * P,
        "optimizer": 8 * P // n if zero >= 1 else 8 * P,
        "transient": scratch + working,
    }


@functools.lru_cache(maxsize=256)
def param_counts(cfg, tp: int = 1) -> dict:
    """Parameters one tp rank holds, from the placement table (parallel/placement.py):
    `replicated` (gpt2: wpe, ln_f, and per block ln_1, ln_2 and the two c_proj biases; llama: the
    norms) whole, `sharded` (the vocabulary padded to vocab_rows(tp), the projections) divided by tp;
    `block` and `embed` are one block's and the groups of no block's (the embedding, and an untied
    head) share of `rank`, the sum."""
    from braidtrain.parallel import placement

    table = placement.for_config(cfg)
    count = lambda entries: sum(e.local_numel(tp) for e in entries)  # noqa: E731
    block = next(entries for module, entries in table.units if module is not None)
    embed = [e for module, entries in table.units if module is None for e in entries]
    return {"rank": count(table), "block": count(block), "embed": count(embed),
            "replicated": count(e for e in table if e.replicated), "sharded": count(e for e in table if not e.replicated),
            "expert": count(e for e in table if e.expert)}


@functools.lru_cache(maxsize=256)
def bucket_numels(cfg, bucket_mb: float, tp: int = 1, table=None) -> tuple[tuple[str, int], ...]:
    """The engine's buckets (parallel/buckets.form on the placement table), in launch order, as
    ("block" or "embed", elements): an untied head's group first, then whole blocks from the last
    one backwards until a bucket holds >= bucket_mb, then the embedding group (gpt2: wte, tied to
    the head, wpe, ln_f) alone: it is used at both ends, so its gradient is last. Sizes are one tp
    rank's (its shards and the replicated parameters). `table`: a pipeline rank's
    (placement.for_rank), where a tied embedding is a bucket of its own (parallel/tied.py)."""
    from braidtrain.parallel import buckets, placement

    alone = {e.name for e in table if e.users} if table is not None else set()
    formed = buckets.form(table or placement.for_config(cfg), lambda e: e.local_numel(tp), bucket_mb, alone)
    return tuple(("block" if mods else "embed", buckets.place([e.local_numel(tp) for e in entries])[1])
                 for entries, mods, _, _ in formed)


def layer_activation(cfg, tp: int = 1, sp: bool = False, cpu: bool = False, fp8: str | None = None) -> float:
    """Bytes per token one block keeps for its backward (the docstring's layers term), traced from
    the family's own block (model/counts.py; its linears in float8 under fp8): the part every tp
    rank holds whole, plus the rest divided by tp."""
    from braidtrain.model.counts import block_activations

    return block_activations(cfg, tp, sp, gpu=not cpu, fp8=fp8)


def activation_bytes(cfg, b: int, t: int, recompute: bool, cpu: bool, P: int, tp: int = 1, sp: bool = False,
                     fp8: str | None = None, P8: int = 0) -> dict:
    """Named terms (see the module docstring), so each can be calibrated on its own; `peak` is
    what they add up to at the worst moment, the start of the backward pass. P: the parameters
    this rank holds (P_tp) -- under recompute, those whose bf16 copies stay (bf16_kept); P8: those
    of them that --fp8 keeps in float8 instead (fp8_params)."""
    scale = 2 if cpu else 1  # fp32 on the CPU
    tbh = t * b * cfg.n_embd * scale
    rows = tp if sp else 1  # the residual stream holds t/tp rows under sp
    layer = layer_activation(cfg, tp, sp, cpu, fp8) * b * t
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


def bf16_kept(cfg, tp: int, P: int, block: int, head: bool) -> int:
    """Parameters whose bf16 (autocast) copies a rank keeps under --recompute: a block's forward
    keeps nothing for its backward but its input, so its copies go with it and come again one block
    at a time; the head's (the fused loss keeps its weight's) stay. Without recompute, all P."""
    return min(P, block + (cfg.vocab_rows(tp) // tp * cfg.n_embd if head else 0))


def tp_messages(cfg, b: int, t: int, sp: bool, cpu: bool = False) -> dict:
    """The tp group's collectives of one micro-step, (kind, bytes) each (the docstring's list):
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


def flops_per_token(s: "Setup", tp: int = 1) -> float:
    """Training FLOPs per token at bf16's rate: the model's, with each block linear's 6 * K * N under
    --fp8 counted 1/fp8_speedup of itself, at its shape on a tp rank."""
    from braidtrain.model.counts import counts

    total = s.cfg.flops_per_token(s.t)
    if s.fp8:
        for n, k, dim in (w for block in counts(s.cfg)["linear"] for w in block):
            local = (k, n // tp) if dim == 0 else (k // tp, n)  # column-parallel splits the outputs, row the inputs
            total -= 6 * n * k * (1 - 1 / fp8_speedup(s.fp8, *local))
    return total


def fp8_params(s: "Setup", tp: int, blocks) -> int:
    """Elements of the blocks' float8 weights (their linears', this tp rank's) under --fp8, else 0."""
    from braidtrain.model.counts import counts

    linear = counts(s.cfg)["linear"]
    return sum(n * k for i in blocks for n, k, _ in linear[i]) // tp if s.fp8 else 0


@dataclass(frozen=True)
class Setup:
    cfg: object  # GPTConfig
    gpus: int
    mem_gb: float
    t: int
    d: int
    tflops: float = 400.0
    busbw: float = 300.0  # GB/s, the replica (dp) group's
    alpha_us: float = 10.0
    bucket_mb: float = Config.bucket_mb
    cpu: bool = False  # the --check on a CPU: fp32, gloo, no CUDA context
    tp_busbw: float | None = None  # GB/s, the tp group's inside a node; None: busbw
    gpus_per_node: int | None = None  # None: every GPU in one node
    node_busbw: float = 40.0  # GB/s of a collective whose group spans nodes (InfiniBand, per GPU)
    fp8: str | None = None  # --fp8's recipe: the blocks' linears in float8


@dataclass(frozen=True)
class Candidate:
    """One layout the planner weighs (layout.make_layout decides whether it can run)."""

    dp: int
    zero: int
    b: int
    recompute: bool
    tp: int = 1
    sp: bool = False
    pp: int = 1
    schedule: str = "sequential"  # the pipeline's (parallel/pipeline.py) when pp > 1
    virtual: int = 1  # chunks a pipeline rank holds (interleaved)
    cp: int = 1  # context parallelism
    cp_impl: str = "ring"  # or "allgather" (parallel/context.py)
    ep: int = 1  # expert parallelism (a mixture of experts)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def name(self) -> str:
        pipe = f" pp={self.pp} {self.schedule}" + (f"x{self.virtual}" if self.virtual > 1 else "") if self.pp > 1 else ""
        return (f"ZeRO-{self.zero} b={self.b}" + (f" tp={self.tp}" if self.tp > 1 else "") + pipe
                + (f" cp={self.cp}" + (" allgather" if self.cp_impl == "allgather" else "") if self.cp > 1 else "")
                + (f" ep={self.ep}" if self.ep > 1 else "") + (" --sp" if self.sp else "")
                + (" --recompute" if self.recompute else ""))

    def layout_kw(self) -> dict:
        """make_layout's arguments for this candidate's degrees and features."""
        pipe = dict(schedule=self.schedule, virtual=self.virtual) if self.pp > 1 else {}
        return dict(tp=self.tp, sp=self.sp, pp=self.pp, cp=self.cp, cp_impl=self.cp_impl, ep=self.ep, zero=self.zero,
                    recompute=self.recompute, **pipe)


def layout_of(s: Setup, lay: Candidate, d: int | None = None, gpus: int | None = None):
    """layout.py's Layout of this candidate (given d, with its micro-batch), or None where `train`
    would refuse it."""
    try:
        return make_layout(gpus or s.gpus, s.cfg, seq_len=s.t, batch_size=lay.b, total_batch=d, **lay.layout_kw())
    except UserError:
        return None


def valid(s: Setup, tp: int, sp: bool = False, b: int = 1, d: int | None = None, gpus: int | None = None,
          **kw) -> bool:
    """Whether `train` would accept this mesh (and, given d, this micro-batch; kw: Candidate's
    other fields): layout.py's verdict."""
    return layout_of(s, Candidate(1, kw.pop("zero", 0), b, kw.pop("recompute", False), tp, sp, **kw), d, gpus) is not None


def tp_degrees(s: Setup, gpus: int | None = None) -> list[int]:
    """The tp degrees the model can be split by on this many GPUs."""
    gpus = gpus or s.gpus
    return [tp for tp in range(1, gpus + 1) if gpus % tp == 0 and valid(s, tp, gpus=gpus)]


def pipelines(s: Setup, tp: int, pps=None, schedules=None):
    """(pp, schedule, virtual) for every pipeline the blocks and the GPUs left by tp allow: pp 1,
    and each pp > 1 with each schedule (interleaved with 2 chunks a rank); pps, schedules: only
    these (None: all; a schedule asked for leaves pp 1 out)."""
    for pp in range(1, s.gpus // tp + 1):
        if s.gpus // tp % pp or (pps is not None and pp not in pps):
            continue
        for name in ("sequential",) if pp == 1 else pipeline.SCHEDULES:
            v = 2 if name == "interleaved" else 1
            if pp == 1 and schedules is None:
                yield pp, name, v
            elif pp > 1 and (schedules is None or name in schedules) and any(
                    valid(s, tp, b=b, d=s.d, pp=pp, schedule=name, virtual=v) for b in MICRO_BATCHES):
                yield pp, name, v


def meshes(s: Setup, tps=None, sps=(False, True), pps=None, schedules=None, cps=None):
    """(dp, tp, sp, (pp, schedule, virtual), cp) for every mesh of s.gpus; tps, pps, cps: only
    these degrees (None: all), sps: these sp settings (sp needs tp > 1 and t divisible by tp),
    schedules: these pipeline schedules."""
    for tp in tp_degrees(s):
        if tps is not None and tp not in tps:
            continue
        for pipe in pipelines(s, tp, pps, schedules):
            rest = s.gpus // (tp * pipe[0])
            for cp in [c for c in range(1, rest + 1) if rest % c == 0]:
                if cps is not None and cp not in cps:
                    continue
                for sp in (False, True) if tp > 1 else (False,):
                    if sp in sps and valid(s, tp, sp, cp=cp):  # with the rest of the layout: layouts()
                        yield rest // cp, tp, sp, pipe, cp


def layouts(s: Setup, zeros=(0, 1, 2, 3), bs=MICRO_BATCHES, recomputes=(False, True), tps=None, sps=(False, True),
            pps=None, schedules=None, cps=None, eps=None):
    E = s.cfg.moe_experts
    for dp, tp, sp, pipe, cp in meshes(s, tps, sps, pps, schedules, cps):
        experts = [e for e in range(1, dp * cp + 1) if (dp * cp) % e == 0 and E % e == 0] if E else [1]
        for ep in [e for e in experts if eps is None or e in eps]:
            for zero in zeros if dp * cp > 1 or len(zeros) == 1 else (0,):  # one replica: nothing to shard
                for b in bs:
                    for rc in recomputes:
                        for impl in ("ring", "allgather") if cp > 1 else ("ring",):
                            lay = Candidate(dp, zero, b, rc, tp, sp, *pipe, cp=cp, cp_impl=impl, ep=ep)
                            if layout_of(s, lay, s.d) is not None:
                                yield lay


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
    t = lambda msgs: sum(collective_s(s, kind, nb, lay.tp, bw) for kind, nb in msgs)  # noqa: E731
    passes = 2 if lay.recompute else 1  # recompute runs each block's forward (and its messages) again
    return s.cfg.n_layer * (passes * t(m["layer_fwd"]) + t(m["layer_bwd"])) + t(m["ends"])


def estimate(s: Setup, lay: Candidate) -> dict:
    if lay.pp > 1:
        return estimate_pipeline(s, lay)
    cfg, n, tp, cp = s.cfg, lay.dp * lay.cp, lay.tp, lay.cp  # n: the replicas, dp x cp
    counts = param_counts(cfg, tp)
    P = counts["rank"] - counts["expert"] + counts["expert"] // lay.ep  # this tp rank's, then sharded by ZeRO
    buckets = bucket_numels(cfg, s.bucket_mb, tp)
    blocks = [k for kind, k in buckets if kind == "block"]
    embed = sum(k for kind, k in buckets if kind == "embed")  # (gathered all micro-step under ZeRO-3)
    state = rank_state(counts["rank"], counts["expert"], n, lay, max(blocks, default=0), embed)
    kept = bf16_kept(cfg, tp, P, counts["block"], True) if lay.recompute else P
    P8 = fp8_params(s, tp, range(1 if lay.recompute else cfg.n_layer))  # (recompute: one block's at a time)
    act = activation_bytes(cfg, lay.b, s.t // cp, lay.recompute, s.cpu, kept, tp, lay.sp, s.fp8, P8)  # a rank's t/cp tokens
    if cfg.moe_experts:
        act["moe"] = moe_bytes(s, lay)
        act["peak"] += act["moe"]
    if cp > 1:
        act = {**act, **ring_bytes(s, lay)}
        act["peak"] += act["ring_out"] + act["ring_scores"]
    mem = {k: state[k] for k in ("params", "grads", "optimizer")}
    mem["activations"] = act["peak"]
    allocated = sum(mem.values())
    communicators = (n > 1) + (tp > 1) + (cp > 1 and lay.dp > 1) + (lay.ep > 1) * (1 + (lay.ep < n))  # + ep, expert
    mem["comm"] = 0 if s.cpu else NCCL_BYTES * communicators
    mem["overhead"] = 0 if s.cpu else CONTEXT_BYTES + ALLOCATOR_SLACK * allocated
    mem["total"] = sum(mem.values())

    micro = max(1, s.d // (lay.b * s.t * lay.dp))
    compute = flops_per_token(s, tp) * s.d / (n * tp * s.tflops * 1e12) * (4 / 3 if lay.recompute else 1)
    fwd = compute / micro * (1 / 4 if lay.recompute else 1 / 3)  # the forward is 1 of 3 (of 4) passes
    bwd = compute / micro - fwd
    # ZeRO-3 gathers the blocks again for the backward only where it reads the fp32 parameters:
    # fp32 (the CPU), or --recompute; under bf16 autocast it reads the bf16 copies the forward saved
    comm = dp_comm_s(s, lay.zero, n, buckets, micro, fwd, bwd, s.cpu or lay.recompute, busbw_of(s, lay, "dp"))
    tp_comm = micro * tp_comm_s(s, lay)
    if lay.sp:  # the replicated parameters' partial gradients, this rank's ZeRO share, once a step
        owned = counts["replicated"] / (n if lay.zero >= 1 else 1)
        tp_comm += collective_s(s, "all_gather", 4 * owned * tp, tp, busbw_of(s, lay, "tp"))
    return finish(s, lay, micro, mem, allocated, state, act, compute, comm, tp_comm, cp_comm=micro * cp_comm_s(s, lay),
                  ep_comm=micro * ep_comm_s(s, lay))


def rank_state(P: int, experts: int, n: int, lay: Candidate, block_params: int, embed_params: int) -> dict:
    """model_state_bytes of a rank that holds P parameters before ep and ZeRO, `experts` of them
    an expert's: those 1/ep of them, sharded over the n/ep replicas holding the same experts."""
    state = model_state_bytes(P - experts, n, lay.zero, block_params, embed_params)
    if experts:
        expert = model_state_bytes(experts // lay.ep, n // lay.ep, lay.zero, 0, 0)
        state = {k: state[k] + expert[k] for k in state}
    return state


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
    from braidtrain.model.counts import moe_activations

    per_row, per_token = moe_activations(s.cfg, lay.tp, lay.sp and lay.tp > 1, gpu=not s.cpu)
    return max(0.0, moe_rows(s, lay) * per_row + lay.b * s.t / lay.cp * per_token)


def moe_bytes(s: Setup, lay: Candidate) -> float:
    """A micro-batch's MoE layers' extra activations: every MoE layer's, one under recompute."""
    n_moe = sum(s.cfg.is_moe(i) for i in range(s.cfg.n_layer))
    return moe_layer_bytes(s, lay) * (1 if lay.recompute else n_moe)


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


def ring_bytes(s: Setup, lay: Candidate) -> dict:
    """What context.py's attention adds to a rank's activations: per block its fp32 output (and
    log-sum-exp), saved for the backward (4 b t/cp C/tp; one block under recompute); and, while a
    block pair is computed, one tile's fp32 scores, probabilities and their gradients (4 x 4 b
    H/tp rows c, context.tile_rows). All-gather adds, for the block in its backward, every rank's
    keys and values (2 b t C/tp) and their fp32 gradients before the reduce-scatter (twice that)."""
    from braidtrain.parallel.context import tile_rows

    b, h, c = lay.b, s.cfg.n_head // lay.tp, s.t // (2 * lay.cp)
    out = 4 * b * (s.t // lay.cp) * (s.cfg.n_embd // lay.tp + h)
    kv = s.cfg.kv_heads * s.cfg.head_dim // lay.tp  # the key/value channels a rank holds
    gathered = 2 * b * s.t * kv * ((4 if s.cpu else 2) + 4) if lay.cp_impl == "allgather" else 0
    return {"ring_out": out * (1 if lay.recompute else s.cfg.n_layer),
            "ring_scores": 16 * b * h * tile_rows(c) * c + gathered}


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
    hop = lambda nbytes: s.alpha_us * 1e-6 + nbytes / (bw * 1e9)  # noqa: E731
    pairs_s = 2 * 4 * b * c * c * C / (s.tflops * 1e12)  # a ring step's attention, forward
    fwd = (cp - 1) * max(0.0, hop(kv) - pairs_s)
    bwd = (cp - 1) * max(0.0, hop(kv) - 2 * pairs_s) + cp * hop(dkv)
    return s.cfg.n_layer * (passes * fwd + bwd)


def finish(s: Setup, lay, micro, mem, allocated, state, act, compute, dp_comm, tp_comm, pp_comm=0.0, cp_comm=0.0,
           ep_comm=0.0, **more) -> dict:
    comm = dp_comm + tp_comm + pp_comm + cp_comm + ep_comm
    step = compute + comm
    return {"layout": lay, "micro_steps": micro, "mem": mem, "allocated": allocated, "state": state,
            "activations": act, "compute_s": compute, "dp_comm_s": dp_comm, "tp_comm_s": tp_comm, "pp_comm_s": pp_comm,
            "cp_comm_s": cp_comm, "ep_comm_s": ep_comm, "comm_s": comm, "step_s": step, "tokens_per_s": s.d / step,
            "fits": mem["total"] <= s.mem_gb * GB, **more}


def dp_comm_s(s: Setup, zero: int, n: int, buckets: list, micro: int, fwd: float, bwd: float, again: bool,
              busbw: float) -> float:
    """Exposed seconds of a rank's data-parallel collectives in a step: its buckets (fp32, in
    launch order) reduced, and gathered, as each ZeRO stage does (the docstring's model); fwd,
    bwd: seconds of a micro-step's forward and backward that they can hide behind; again: ZeRO-3
    gathers the blocks again for the backward; busbw: the replica group's."""
    msg = [4 * k for _, k in buckets]
    ar, rs, ag = ([collective_s(s, kind, m, n, busbw) for m in msg] for kind in ("all_reduce", "reduce_scatter", "all_gather"))
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
    from braidtrain.parallel import placement

    cfg, n, tp, pp, cp = s.cfg, lay.dp * lay.cp, lay.tp, lay.pp, lay.cp  # n: the replicas, dp x cp
    L = layout_of(s, lay, s.d)
    split, m, chunks = L.split, L.batch.micro_steps, len(L.split)
    t = s.t // cp  # a rank's tokens of each sequence
    terms = activation_bytes(cfg, lay.b, t, lay.recompute, s.cpu, 0, tp, lay.sp, s.fp8)  # pp = 1's, per micro-batch
    per_block = terms["layers"] / cfg.n_layer
    ring = ring_bytes(s, lay) if cp > 1 else {"ring_out": 0, "ring_scores": 0}
    one_ring = ring["ring_out"] / (1 if lay.recompute else cfg.n_layer)  # one block's
    moe = moe_layer_bytes(s, lay) if cfg.moe_experts else 0
    kept = lambda i: per_block + (0 if lay.recompute else one_ring + moe * cfg.is_moe(i))  # noqa: E731
    size = lambda c: sum(map(kept, split[c])) + (terms["head"] + terms["logits"] if c == chunks - 1 else 0)  # noqa: E731
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
        P, experts, replicated, buckets = stage_counts(cfg, split, pp, r, tp, s.bucket_mb)
        blocks = [k for kind, k in buckets if kind == "block"]
        state = rank_state(P, experts, n, lay, max(blocks, default=0), sum(k for kind, k in buckets if kind != "block"))
        if lay.schedule == "zb" and lay.zero == 2:  # W opens every block bucket's scratch at once (engine.py)
            extra = 4 * max(0, sum(blocks) - 2 * max(blocks, default=0))
            state = {**state, "grads": state["grads"] + extra, "transient": state["transient"] + extra}
        mine = range(r, chunks, pp)
        held = [i for c in mine for i in split[c]]
        rebuilt = terms["block_recomputed"] + (one_ring + moe * any(map(cfg.is_moe, held)) if lay.recompute else 0)
        held_p = P - experts + experts // lay.ep
        kept = bf16_kept(cfg, tp, held_p, param_counts(cfg, tp)["block"], chunks - 1 in mine) if lay.recompute else held_p
        P8 = fp8_params(s, tp, held[:1] if lay.recompute else held)
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
                       busbw_of(s, lay, "dp"))
        rows.append({"mem": mem, "allocated": allocated, "state": state, "act": act, "end": sim["end"] + dp,
                     "blocks": len(held), "moe": sum(map(cfg.is_moe, held)), "bubble": max(0.0, 1 - sim["busy"] / sim["end"]),
                     "replicated": replicated})
    span = max(sim["end"] for sim in ranks)
    step_end = max(row["end"] for row in rows)
    busiest = max(row["blocks"] for row in rows) / cfg.n_layer  # tp's and cp's messages are on its critical path
    tp_comm = m * tp_comm_s(s, lay) * busiest
    if lay.sp:
        owned = max(row["replicated"] for row in rows) / (n if lay.zero >= 1 else 1)
        tp_comm += collective_s(s, "all_gather", 4 * owned * tp, tp, busbw_of(s, lay, "tp"))
    wte = sum(e.local_numel(tp) for e in placement.for_config(cfg) if e.users) / (n if lay.zero >= 1 else 1)
    tied = (s.alpha_us * 1e-6 + 4 * wte / (busbw_of(s, lay, "pp") * 1e9)) if wte else 0.0  # first and last stage swap their reduced shares
    full = max(rows, key=lambda row: row["mem"]["total"])
    return finish(s, lay, m, full["mem"], full["allocated"], full["state"], full["act"], span, step_end - span,
                  tp_comm, tied, cp_comm=m * cp_comm_s(s, lay) * busiest,
                  ep_comm=m * ep_comm_s(s, lay) * max(row["moe"] for row in rows) / n_moe,
                  bubble=[row["bubble"] for row in rows], stages_gb=[row["mem"]["total"] / GB for row in rows],
                  stage_state=[row["state"] for row in rows])


@functools.lru_cache(maxsize=1024)
def stage_counts(cfg, split: tuple, pp: int, r: int, tp: int, bucket_mb: float) -> tuple:
    """Pipeline rank r's parameters (placement.for_rank), its experts', its replicated ones, and
    its buckets (cached: each (mesh, split) is weighed at many ZeRO stages, b and recompute)."""
    from braidtrain.parallel import placement

    table = placement.for_rank(cfg, split, pp, r)
    count = lambda keep: sum(e.local_numel(tp) for e in table if keep(e))  # noqa: E731
    return (count(lambda e: True), count(lambda e: e.expert), count(lambda e: e.replicated),
            bucket_numels(cfg, bucket_mb, tp, table))


@functools.lru_cache(maxsize=4096)
def simulated(name: str, pp: int, v: int, m: int, cost: tuple, hop: float, size: tuple) -> list[dict]:
    """pipeline.simulate of the schedule with per-chunk costs (F, B, W) and sizes; past SIM_MICRO
    cycles of pp micro-batches, simulated at two lengths and extrapolated linearly in m (after
    the warm-up each cycle adds the same time, and the same activations -- none but gpipe's)."""
    run = lambda k: pipeline.simulate(pipeline.build(name, pp, v, k), pp,  # noqa: E731
                                      lambda a: cost["FBW".index(a.op)][a.stage], hop, lambda c: size[c])
    lo = SIM_MICRO * pp * v
    if m <= lo + pp:
        return run(m)
    short, long_ = run(lo), run(lo + pp)
    k = (m - lo) / pp
    return [{key: a[key] + k * (z[key] - a[key]) for key in a} for a, z in zip(short, long_)]


def lean_layout(s: Setup, gpus: int) -> Candidate | None:
    """The leanest layout on this many GPUs that fits: ZeRO-3 b=1 --recompute, with the smallest
    tp (and sp where it can) that fits; failing that, a 1f1b pipeline (ZeRO-2) of the fewest
    stages with the smallest tp; None if none does."""
    on = replace(s, gpus=gpus)
    tps = tp_degrees(s, gpus)
    tried = [Candidate(gpus // tp, 3, 1, True, tp, tp > 1 and valid(s, tp, True, gpus=gpus)) for tp in tps]
    tried += [Candidate(gpus // (tp * pp), 2, 1, True, tp, tp > 1 and valid(s, tp, True, gpus=gpus), pp, "1f1b")
              for pp in range(2, gpus + 1) for tp in tps if gpus % (tp * pp) == 0]
    for lay in tried:
        if layout_of(on, lay, s.d) is not None and estimate(on, lay)["fits"]:
            return lay
    return None


def gpus_needed(s: Setup, limit: int = 1 << 16) -> Candidate | None:
    """The fewest GPUs (doubling) on which a leanest layout fits, and that layout."""
    m = s.gpus * 2
    while m <= limit:
        lay = lean_layout(s, m)
        if lay is not None:
            return lay
        m *= 2
    return None


def rank(rows: list[dict]) -> list[dict]:
    """Fits first, then by step time. Times equal to 3 digits are a tie (the model cannot tell
    them apart); then fewer micro-steps (larger GEMMs, which a constant --tflops does not see),
    less sharding (tp first: its GEMMs are smaller too), less memory."""
    return sorted(rows, key=lambda e: (not e["fits"], float(f"{e['step_s']:.3g}"), e["micro_steps"],
                                       e["layout"].tp, e["layout"].pp, e["layout"].cp, e["layout"].zero,
                                       e["mem"]["total"]))


SETTINGS = ("tp", "sp", "pp", "schedule", "cp", "cp_impl", "ep", "zero", "b", "recompute")  # what a fix may change (dp follows)


@functools.lru_cache(maxsize=None)
def settings(lay: Candidate) -> tuple:
    return tuple(getattr(lay, k) for k in SETTINGS)


MESH = ("dp", "tp", "sp", "pp", "schedule", "virtual", "cp", "cp_impl", "ep")  # a row of the table each, by default


def best_per_mesh(rows: list[dict]) -> list[dict]:
    """The first (best-ranked) row of each mesh, in rank order."""
    seen = set()
    return [e for e in rows if (key := tuple(getattr(e["layout"], k) for k in MESH)) not in seen and not seen.add(key)]


def settings_grid(rows: list[dict]):
    import numpy as np

    grid = np.empty((len(rows), len(SETTINGS)), dtype=object)
    for i, row in enumerate(rows):
        grid[i] = settings(row["layout"])
    return grid


def fix(s: Setup, e: dict, fitting: list[dict], grid=None) -> str:
    """The smallest change that makes a layout fit: the fitting layouts that differ from it in
    the fewest settings (the best of each kind of change); failing any, larger or more GPUs.
    grid: the fitting layouts' settings as an array (settings_grid), when many rows ask."""
    import numpy as np

    lay = e["layout"]
    grid = settings_grid(fitting) if grid is None else grid
    differs = grid != np.array(settings(lay), dtype=object)  # fitting x SETTINGS
    counts = differs.sum(axis=1)
    changed = lambda i: tuple(k for k, d in zip(SETTINGS, differs[i]) if d)  # noqa: E731
    say = {"tp": lambda l: f"tp={l.tp}", "sp": lambda l: "--sp" if l.sp else "no sp",
           "pp": lambda l: f"pp={l.pp}", "schedule": lambda l: l.schedule if l.pp > 1 else "",
           "cp": lambda l: f"cp={l.cp}", "cp_impl": lambda l: f"--cp-impl {l.cp_impl}" if l.cp > 1 else "",
           "ep": lambda l: f"ep={l.ep}",
           "zero": lambda l: f"ZeRO-{l.zero}", "b": lambda l: f"b={l.b}",
           "recompute": lambda l: "--recompute" if l.recompute else "no recompute"}
    opts = []
    if fitting:
        for i in np.flatnonzero(counts == counts.min()):  # best first: the first of each kind of change is its best
            ks = changed(i)
            if not any(ks == o[0] for o in opts):
                opts.append((ks, " ".join(filter(None, (say[k](fitting[i]["layout"]) for k in ks)))))
        opts = [o[1] for o in opts]
    else:
        opts.append(f"GPUs with >= {math.ceil(e['mem']['total'] / GB)} GB")
        m = gpus_needed(s)
        opts += [f"{m.gpus} GPUs with {m.name()}"] if m else []
    return f"{lay.name()} needs {e['mem']['total'] / GB:.1f} GB > {s.mem_gb:g} GB: use " + ", or ".join(opts)


def advice(s: Setup, lay: Candidate) -> str:
    """What the planner says of a layout that ran out of memory: its estimate and, if the
    estimate is over the memory too, the smallest change that fits (else: the estimate is short)."""
    e = estimate(s, lay)
    est = f"the planner estimates {e['mem']['total'] / GB:.1f} GB a rank for {lay.name()} (of {s.mem_gb:.1f} GB)"
    if e["fits"]:
        fitting = sorted((f for f in rank([estimate(s, x) for x in layouts(s)]) if f["mem"]["total"] < 0.8 * e["mem"]["total"]),
                         key=lambda f: f["step_s"])
        return est + " -- an underestimate here" + (f"; leaner: {fitting[0]['layout'].name()}" if fitting else "")
    grid = rank([estimate(s, x) for x in layouts(s)])
    change = fix(s, e, [f for f in grid if f["fits"]])
    return est + "; " + change[change.index(": use ") + 2:]


def candidate_of(lay) -> Candidate:
    """The planner's Candidate of a run's layout.Layout."""
    pipe = dict(schedule=lay.schedule, virtual=lay.virtual) if lay.pp > 1 else {}
    return Candidate(lay.dp, lay.zero, lay.batch.seqs_per_rank // lay.batch.micro_steps, lay.recompute, lay.tp, lay.sp,
                     lay.pp, cp=lay.cp, cp_impl=lay.cp_impl, ep=lay.ep, **pipe)


def nothing_fits(s: Setup, grid: list[dict]) -> str:
    lean = min(grid, key=lambda e: e["mem"]["total"])
    need = lean["mem"]["total"] / GB
    msg = (f"nothing fits on {s.gpus} x {s.mem_gb:g} GB: the leanest layout, {lean['layout'].name()}, "
           f"needs {need:.1f} GB per GPU; use GPUs with >= {math.ceil(need)} GB")
    m = gpus_needed(s)
    if m:
        unit = s.t * m.dp
        msg += f", or {m.gpus} GPUs with {m.name()}" + (f" (-d a multiple of {unit})" if s.d % unit else "")
    return msg


def plan(s: Setup, zeros=(0, 1, 2, 3), bs=MICRO_BATCHES, recomputes=(False, True), tps=None, sps=(False, True),
         pps=None, schedules=None, cps=None, eps=None, variants: bool = True) -> dict:
    """The layouts asked for, ranked, each that does not fit with its fix; the fixes and the
    recommendation look at every layout. variants=False: only each mesh's best layout."""
    seen = {}
    weigh = lambda lay: seen[lay] if lay in seen else seen.setdefault(lay, estimate(s, lay))  # noqa: E731
    grid = rank([weigh(lay) for lay in layouts(s)])
    rows = rank([weigh(lay) for lay in layouts(s, zeros, bs, recomputes, tps, sps, pps, schedules, cps, eps)])
    rows = rows if variants else best_per_mesh(rows)
    if not rows or not grid:
        unit = s.t * s.gpus
        raise UserError(f"-d {s.d} is not a multiple of b*t*dp = b*{s.t}*{s.gpus}/(tp*pp) for any allowed b, tp "
                        f"and pp: use -d {max(1, s.d // unit) * unit}")
    fitting = [e for e in grid if e["fits"]]
    grid_of_fits = settings_grid(fitting)
    for e in rows:
        e["fix"] = None if e["fits"] else fix(s, e, fitting, grid_of_fits)
    best = rows[0] if rows[0]["fits"] else fitting[0] if fitting else None
    if best is None:
        rec = nothing_fits(s, grid)
    else:
        rec = (f"recommended: {best['layout'].name()} on {s.gpus} GPU(s), {best['micro_steps']} micro-step(s): "
               f"{best['mem']['total'] / GB:.1f} of {s.mem_gb:g} GB, {best['step_s']:.3f} s/step, "
               f"{best['tokens_per_s']:,.0f} tokens/s" + ("" if best is rows[0] else " (none of the layouts asked for fits)"))
    return {"rows": rows, "recommendation": rec}


def auto_layout(cfg, model, world: int, device: str, gpus_per_node: int | None = None,
                mem_gb: float | None = None) -> tuple[dict, str]:
    """--layout auto: the best-ranked layout that fits these processes' memory (each GPU's, or on
    the CPU the machine's over the processes) and that `train` accepts with the run's other
    settings (--exact, --compile, --cuda-graph); the Config values it sets (config.AUTO_CHOSEN)
    and a line saying what it chose. Every rank computes the same plan: nothing to agree on.
    mem_gb: a process's memory (default: the GPU's, or the CPU's share)."""
    import os

    import torch

    if not cfg.total_batch:
        raise UserError("--layout auto keeps the tokens per step fixed and chooses the rest: give -d (--total-batch)")
    cpu = device != "cuda"
    if mem_gb is None:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world if cpu else torch.cuda.mem_get_info()[1]
        mem_gb = mem / GB
    s = Setup(model, world, mem_gb, cfg.seq_len, cfg.total_batch, bucket_mb=cfg.bucket_mb, cpu=cpu, fp8=cfg.fp8,
              gpus_per_node=gpus_per_node)
    rows = plan(s)["rows"]
    for e in (e for e in rows if e["fits"]):
        lay = e["layout"]
        try:
            make_layout(world, model, seq_len=s.t, batch_size=lay.b, total_batch=s.d, exact=cfg.exact, compile=cfg.compile,
                        cuda_graph=cfg.cuda_graph, cp_order=cfg.cp_order, device=device, **lay.layout_kw())
        except UserError:
            continue
        chosen = dict(pp=lay.pp, pp_schedule=lay.schedule if lay.pp > 1 else "1f1b", pp_split=None,
                      pp_virtual=lay.virtual if lay.pp > 1 and lay.virtual > 1 else None, cp=lay.cp, cp_impl=lay.cp_impl,
                      tp=lay.tp, sp=lay.sp, ep=lay.ep, zero=lay.zero, batch_size=lay.b, recompute=lay.recompute)
        speed = "" if cpu else f", {e['tokens_per_s']:,.0f} tokens/s at {s.tflops:g} TFLOP/s"
        return chosen, f"--layout auto: {lay.name()}, dp {lay.dp} (planned {e['mem']['total'] / GB:.1f} of {s.mem_gb:.1f} GB{speed})"
    if not any(e["fits"] for e in rows):
        raise UserError("--layout auto: " + nothing_fits(s, rows))
    flags = " ".join(f for f, on in (("--exact", cfg.exact), ("--compile", cfg.compile), ("--cuda-graph", cfg.cuda_graph)) if on)
    raise UserError(f"--layout auto: no layout that fits runs with {flags}: drop {flags}, or choose the layout by hand")
