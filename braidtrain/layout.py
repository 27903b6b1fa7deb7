"""The layout of a run: the degrees of the mesh and the engine's features, validated once.

    degrees   pp (pipeline stages) x dp (data-parallel replicas) x cp (context) x tp (tensor),
              outer to inner, = the world size; ep (expert) is carved from the dp*cp ranks
    features  ZeRO stage, sp, exact, compile, CUDA graph, recompute, the schedule, float8

`make_layout` is the one place that decides whether a combination can run. `train` calls it
(through `from_config`) before any process group forms, and `plan` calls it for every layout it
proposes, so neither can accept what the other refuses. Each refusal is a UserError whose one
line says what to change. What it needs to know: the world size, the model's shape, the batch
and the device type -- all known before the ranks have met.

Exact mode (README's first promise) holds at a fixed tp: splitting a matmul over tp ranks
changes the order of its sums. Across dp, ZeRO stages and restarts the bits are the same; a run
resumed on another tp says so in one line (build.py) and differs from there on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from braidtrain.errors import UserError, divisors
from braidtrain.parallel import pipeline

FP8_RECIPES = ("tensorwise", "rowwise")  # model/fp8.py's (named here: the layout is checked before torch loads)

@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's -d tokens are split: the same d over any layout, micro-steps d / (b*t*dp)."""

    total_tokens: int  # d
    seqs_per_step: int  # d / t, over all ranks
    micro_steps: int  # per rank: d / (b * t * dp)
    seqs_per_rank: int  # micro_steps * b


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    cp: int
    tp: int
    ep: int
    zero: int
    sp: bool
    exact: bool
    compile: bool
    cuda_graph: bool
    recompute: bool
    schedule: str  # the order of a step's forwards and backwards (parallel/pipeline.py; "sequential" at pp 1)
    batch: BatchPlan
    virtual: int = 1  # pipeline chunks a rank holds (interleaved)
    split: tuple = ()  # the blocks of each pipeline chunk (ranges), pp * virtual of them
    cp_impl: str = "ring"  # context parallelism's (parallel/context.py)
    cp_order: str = "zigzag"
    fp8: str | None = None  # the blocks' linear layers in float8: tensorwise | rowwise (model/fp8.py)
    offload: str | None = None  # "optimizer": master weights and moments in host memory (parallel/offload.py)
    offload_ratio: float = 1.0  # the share of a rank's owned optimizer elements on the host (offload.kept)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def data_parallel_only(self) -> bool:
        return self.pp == self.cp == self.tp == self.ep == 1

    def describe(self) -> str:
        """One line for the start of a run: 'dp 2 x tp 2 (sp), ZeRO-1, exact'; with a pipeline,
        its schedule and split: 'pp 2 (1f1b, blocks 0-7 | 8-11) x dp 2, ZeRO-1'."""
        pipe = ""
        if self.pp > 1:
            cut = " | ".join(f"{r.start}-{r.stop - 1}" for r in self.split)
            pipe = f" ({self.schedule}{f' x{self.virtual} chunks a rank' if self.virtual > 1 else ''}, blocks {cut})"
        ctx = f" ({self.cp_impl}, {self.cp_order})"
        axes = " x ".join(f"{a} {getattr(self, a)}" + {"pp": pipe, "cp": ctx}.get(a, "")
                          for a in ("pp", "dp", "cp", "tp", "ep") if getattr(self, a) > 1 or a == "dp")
        switches = (("exact", self.exact), ("recompute", self.recompute), ("compile", self.compile),
                    ("cuda-graph", self.cuda_graph))
        features = [f"ZeRO-{self.zero}"] + [n for n, on in switches if on]
        features += [f"fp8 {self.fp8}"] if self.fp8 else []
        ratio = f" (ratio {self.offload_ratio:g})" if self.offload_ratio < 1 else ""
        features += [f"offload {self.offload}{ratio}"] if self.offload else []
        return axes + (" (sp)" if self.sp else "") + ", " + ", ".join(features)


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


def batch_plan(total_batch: int | None, b: int, t: int, dp: int) -> BatchPlan:
    unit = b * t * dp
    d = total_batch if total_batch is not None else unit
    if d % unit:
        near = f"-d {d // unit * unit} or -d {(d // unit + 1) * unit}" if d > unit else f"-d {unit}"
        raise UserError(f"-d {d} is not a multiple of b*t*dp = {b}*{t}*{dp} = {unit}: use {near}")
    micro = d // unit
    return BatchPlan(d, d // t, micro, micro * b)


def check_tp(model, tp: int, sp: bool = False, seq_len: int | None = None) -> None:
    """A tensor-parallel degree this model (its family says: model/protocol.py check_tp) and, under
    sp, this sequence length can be split by."""
    model.check_tp(tp)
    if sp and tp > 1 and seq_len is not None and seq_len % tp:
        raise UserError(f"sequence length {seq_len} is not divisible by tp={tp}: sequence parallelism "
                        f"splits the sequence over the tp ranks; use a multiple of {tp} (or drop --sp)")


def make_layout(world: int, model, *, seq_len: int, batch_size: int, total_batch: int | None = None,
                pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, zero: int = 0, sp: bool = False,
                exact: bool = False, compile: bool = False, cuda_graph: bool = False, recompute: bool = False,
                schedule: str = "1f1b", virtual: int | None = None, split: list[int] | None = None,
                cp_impl: str = "ring", cp_order: str = "zigzag", fp8: str | None = None, device: str = "cpu",
                world_name: str | None = None, offload: str | None = None,
                offload_ratio: float | None = None) -> Layout:
    """The validated layout, or the UserError of the first thing that cannot run. `model` is a
    model config (model/protocol.py); `schedule`, `virtual` (chunks a rank; default 2 for interleaved, else 1) and
    `split` (blocks per chunk; default the cost model's) are the pipeline's, ignored at pp 1;
    `device` the device type ('cpu' or 'cuda'); `world_name`: what the world size is to the user
    (`plan`: its --gpus; `train`: the processes started)."""
    # 1. each degree, and the features against each other
    for name, size in (("pp", pp), ("cp", cp), ("tp", tp), ("ep", ep)):
        if size < 1:
            raise UserError(f"--{name} {size}: every parallel degree must be >= 1")
    moe = getattr(model, "moe_experts", 0)
    check_offload(offload, cuda_graph, offload_ratio)
    if ep > 1 and not moe:
        raise UserError(f"--ep {ep} shards a mixture of experts: give --moe-experts (and --moe-top-k), or use --ep 1")
    if moe and (compile or cuda_graph) and (ep > 1 or exact):
        # (at ep 1 outside exact mode every shape of the layer is known before the step: model/moe.py)
        raise UserError(f"{'--compile' if compile else '--cuda-graph'} with a mixture of experts needs ep 1 and no "
                        f"--exact (the all-to-all's splits and exact mode's per-source calls are known only at run "
                        f"time): drop it, or use --ep 1 without --exact")
    if ep > 1 and moe % ep:
        raise UserError(f"--ep {ep} does not divide --moe-experts {moe}: use ep in {divisors(moe)}")
    if fp8 not in (None, *FP8_RECIPES):
        raise UserError(f"unknown --fp8 recipe {fp8!r}: use {' or '.join(FP8_RECIPES)}")
    if sp and tp == 1:
        raise UserError("--sp splits the sequence over the tp ranks: it needs --tp 2 or more (or drop --sp)")
    if compile and tp > 1:
        raise UserError("--compile with tensor parallelism (tp > 1) is not supported yet: drop --compile or use tp=1")
    if cuda_graph and (tp > 1 or zero > 1):
        raise UserError("--cuda-graph supports ZeRO 0 or 1 without tensor parallelism: drop --cuda-graph, "
                        "or use -z 0 or 1 and tp=1")
    if cuda_graph and device != "cuda":
        raise UserError(f"--cuda-graph needs a GPU (this run is on {device}): drop --cuda-graph")
    if schedule not in pipeline.SCHEDULES:
        raise UserError(f"unknown pipeline schedule '{schedule}': use one of {', '.join(pipeline.SCHEDULES)}")
    if virtual is not None and (virtual < 1 or (virtual > 1 and schedule != "interleaved")):
        raise UserError(f"--pp-virtual {virtual}: more than one chunk a rank is the interleaved schedule's: "
                        f"use --pp-schedule interleaved, or --pp-virtual 1")
    v = (virtual or (2 if schedule == "interleaved" else 1)) if pp > 1 else 1
    if pp > 1:
        if zero == 3:
            raise UserError("ZeRO-3 with pipeline parallelism is not supported: a stage already holds only its own "
                            "layers, and ZeRO-3's gathers would meet the stages' transfers; use -z 1 or -z 2")
        if cuda_graph:
            raise UserError("--cuda-graph with pipeline parallelism is not supported (the stages' transfers "
                            "are not captured): drop --cuda-graph")
        if schedule == "zb" and (recompute or compile):
            raise UserError(f"--pp-schedule zb splits each backward on the graph its forward built, which "
                            f"{'--recompute' if recompute else '--compile'} hides: drop it, or use --pp-schedule 1f1b")
    # 2. against the model and the sequence
    if seq_len > model.block_size:
        raise UserError(f"-t {seq_len} is longer than the model's context ({model.block_size}): "
                        f"use -t {model.block_size} or less")
    check_tp(model, tp, sp, seq_len)
    if cp > 1:
        _check_cp(cp, tp, sp, seq_len, compile, cuda_graph, exact)
    # 3. against the world size and the batch
    inner = pp * cp * tp
    if world % inner:
        what = world_name or f"the world size {world} (processes started)"
        raise UserError(f"pp*cp*tp = {pp}*{cp}*{tp} = {inner} does not divide {what}: use a multiple of {inner} "
                        f"ranks, or other degrees")
    dp = world // inner
    if (dp * cp) % ep:
        raise UserError(f"--ep {ep} does not divide the dp*cp = {dp}*{cp} = {dp * cp} ranks it is carved from: "
                        f"use ep in {divisors(math.gcd(dp * cp, moe or 1))}")
    batch = batch_plan(total_batch, batch_size, seq_len, dp)
    if exact:
        _check_exact(dp, batch.micro_steps, batch_size * seq_len * dp, model, device if cp == 1 else "cpu")
        if ep > 1 and not _pow2(batch.micro_steps):  # (the ep sources' subtrees: parallel/expert.Sourced)
            raise UserError(f"--exact with ep={ep} needs a power-of-two number of micro-steps per rank, got "
                            f"d/(b*t*dp) = {batch.micro_steps}: change -d")
    ctx = dict(cp_impl=cp_impl, cp_order=cp_order, fp8=fp8, offload=offload,
               offload_ratio=1.0 if offload_ratio is None else offload_ratio)
    if pp == 1:
        return Layout(pp, dp, cp, tp, ep, zero, sp, exact, compile, cuda_graph, recompute, "sequential", batch, **ctx)
    pipeline.check_split(model.n_layer, pp * v, split)
    m, unit = batch.micro_steps, batch_size * seq_len * dp
    if schedule in ("1f1b", "zb", "interleaved") and m < pp:
        raise UserError(f"--pp-schedule {schedule} needs at least pp = {pp} micro-steps per rank, got d/(b*t*dp) = "
                        f"{m}: use -d {pp * unit} or more (or --pp-schedule gpipe)")
    if schedule == "interleaved" and m % pp:
        raise UserError(f"--pp-schedule interleaved needs a multiple of pp = {pp} micro-steps per rank, got "
                        f"d/(b*t*dp) = {m}: use -d {m // pp * pp * unit} or -d {(m // pp + 1) * pp * unit}")
    if split is not None:
        chunks = pipeline.split(model.n_layer, pp * v, by_hand=split)
    else:
        chunks = pipeline.cost_split(model, seq_len, pp * v)
    return Layout(pp, dp, cp, tp, ep, zero, sp, exact, compile, cuda_graph, recompute, schedule, batch, v,
                  tuple(chunks), **ctx)


def check_offload(offload: str | None, cuda_graph: bool, ratio: float | None, flag="--offload optimizer") -> None:
    """(`flag`: how the command asks for optimizer offload -- plan's is --offload)"""
    if ratio is not None and offload != "optimizer":
        raise UserError(f"--offload-ratio {ratio:g} is the share of the optimizer's state on the host: it needs {flag}")
    if ratio is not None and not 0 < ratio <= 1:
        raise UserError(f"--offload-ratio {ratio:g}: give the share of the optimizer's state on the host, "
                        "0 < R <= 1 (1: all of it)")
    if offload in (None, "optimizer"):
        if offload and cuda_graph:
            raise UserError("--offload optimizer updates on the host inside each step, which a CUDA graph cannot "
                            "replay: drop --cuda-graph (or --offload)")
        return
    if offload == "params":
        raise UserError("--offload params (ZeRO-3's parameter shards in host memory) is not built yet: use "
                        "--offload optimizer, with -z 3 for sharded parameters")
    raise UserError(f"unknown --offload {offload!r}: use optimizer (or leave it unset)")


def _check_cp(cp: int, tp: int, sp: bool, t: int, compile: bool, cuda_graph: bool, exact: bool) -> None:
    """A sequence of t tokens splits into 2*cp equal chunks (and, under sp, a rank's t/cp into tp)."""
    unit = 2 * cp if not sp else math.lcm(2 * cp, cp * tp)
    if t % unit:
        near = " or ".join(f"-t {x}" for x in (t // unit * unit, (t // unit + 1) * unit) if x > 0)
        why = f"2*cp = {2 * cp} chunks" if not sp else f"2*cp = {2 * cp} chunks, each rank's t/cp over tp = {tp} (sp)"
        raise UserError(f"-t {t} does not split into {why}: use {near} (a multiple of {unit}), or another --cp")
    if compile or cuda_graph:
        raise UserError(f"{'--compile' if compile else '--cuda-graph'} with context parallelism (cp > 1) is not "
                        f"supported yet (the ring's transfers inside attention): drop it, or use --cp 1")
    if exact and not _pow2(cp):
        raise UserError(f"--exact needs a power-of-two cp (its gradients are summed along one tree over the "
                        f"dp*cp replicas), got cp={cp}: use 2, 4, 8 ...")


def _check_exact(dp: int, micro: int, unit: int, model, device: str) -> None:
    """Exact mode needs the canonical tree: dp a power of two, and (when dp > 1) a power-of-two
    number of micro-steps per rank so that each rank holds one complete subtree; on a GPU, the
    deterministic Triton attention for the model's head size."""
    if not _pow2(dp):
        raise UserError(f"--exact needs a power-of-two data-parallel size, got dp={dp}: use 1, 2, 4, 8 ... processes")
    if dp > 1 and not _pow2(micro):
        lo = 1 << (micro.bit_length() - 1)
        raise UserError(f"--exact with dp={dp} needs a power-of-two number of micro-steps per rank, got "
                        f"d/(b*t*dp) = {micro}: use -d {lo * unit} or -d {2 * lo * unit}")
    if device == "cuda":  # (under cp, context.py's attention, which needs neither: the caller passes "cpu")
        from braidtrain.model import attention  # (here: importing it costs seconds, and `plan` parses with layout.py)

        if not attention.available("cuda"):
            raise UserError("--exact on GPU needs triton (for the deterministic attention): pip install triton")
        if model.head_dim not in attention.HEAD_DIMS:
            raise UserError(f"--exact on GPU supports head sizes {attention.HEAD_DIMS} (n_embd / n_head), got "
                            f"{model.n_embd} / {model.n_head} = {model.head_dim}: change --n-head, or drop --exact")


def check_fp8(recipe: str | None, device: str) -> None:
    """--fp8 where it runs: a GPU of compute capability 8.9 or later (torch._scaled_mm), or a CPU
    (an fp32 matmul of the float8 values, model/fp8.py). Asked of the device a run trains on
    (from_config); the planner weighs GPUs it does not have."""
    if recipe is None:
        return
    import torch

    from braidtrain.model import fp8

    if fp8.available(device):
        return
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        raise UserError(f"--fp8 needs a GPU of compute capability 8.9 or later (float8 tensor cores: Ada, Hopper); "
                        f"this one is {major}.{minor}: drop --fp8")
    raise UserError(f"--fp8 runs on CUDA GPUs and CPUs, not on {device}: drop --fp8")


def check_attention(kernel: str, exact: bool, device: str, head_dim: int) -> None:
    """--attention flash4 where flash-attn-4 runs (model/flash4.py): a Hopper or Blackwell GPU with the
    package installed, a head size its kernels take. (--exact on a GPU keeps its own kernels; config.validate
    refuses the pair.)"""
    if kernel != "flash4" or exact:
        return
    from braidtrain.model import flash4

    if not flash4.available(device):
        raise UserError(f"--attention flash4 needs the flash-attn-4 package (pip install flash-attn-4) and a GPU of "
                        f"compute capability 9 or 10 (Hopper, Blackwell); this run is on {device}: use --attention "
                        f"sdpa or auto")
    if not flash4.fits(head_dim):
        raise UserError(f"--attention flash4 takes a head size (n_embd / n_head) that is a multiple of 8 up to 128, "
                        f"or 256, not {head_dim}: use --attention sdpa or auto")


def from_config(cfg, world: int, model, device: str) -> Layout:
    """The layout a training Config asks for on `world` processes (train.py's one call)."""
    split = None
    if cfg.pp_split:
        try:
            split = [int(k) for k in cfg.pp_split.split(",")]
        except ValueError:
            raise UserError(f"--pp-split {cfg.pp_split!r}: give blocks per chunk as integers, e.g. 3,4,4,3") from None
    lay = make_layout(world, model, seq_len=cfg.seq_len, batch_size=cfg.batch_size, total_batch=cfg.total_batch,
                      pp=cfg.pp, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep, zero=cfg.zero, sp=cfg.sp, exact=cfg.exact,
                      compile=cfg.compile, cuda_graph=cfg.cuda_graph, recompute=cfg.recompute, schedule=cfg.pp_schedule,
                      virtual=cfg.pp_virtual, split=split, cp_impl=cfg.cp_impl, cp_order=cfg.cp_order, fp8=cfg.fp8,
                      device=device, offload=cfg.offload, offload_ratio=cfg.offload_ratio)
    if cfg.offload and cfg.live_recovery:
        raise UserError("--offload optimizer with --live-recovery is not supported: a survivor re-shards the "
                        "optimizer state on the device (parallel/mirror.py); drop one of them")
    check_fp8(lay.fp8, device)
    check_attention(cfg.attention, cfg.exact, device, model.head_dim)
    return lay
