"""The layouts the planner weighs: a Setup (the model, the GPUs, the batch and the machine's
speeds), a Candidate (one layout), and the generators of candidates over the five axes, ZeRO, the
micro-batch and recompute. layout.make_layout -- the validator `train` runs -- says which can run.
docs/planner.md describes the model."""

from __future__ import annotations

from dataclasses import dataclass

from braidtrain.config import Config
from braidtrain.errors import UserError
from braidtrain.layout import make_layout
from braidtrain.parallel import pipeline

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)


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
    compile: bool = False  # --compile: its partition keeps fewer activations (model/counts.py traces it)
    live: bool = False  # --live-recovery: no expert parallelism; at ZeRO 1-3 the buddy copies (parallel/mirror.py)
    host_gb: float = 128.0  # host memory of a node (--offload's master weights and moments live there)


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
    offload: bool = False  # --offload optimizer (parallel/offload.py)
    ratio: float = 1.0  # --offload-ratio: the share of the optimizer's state on the host (offload.kept)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def name(self) -> str:
        pipe = ""
        if self.pp > 1:
            pipe = f" pp={self.pp} {self.schedule}" + (f"x{self.virtual}" if self.virtual > 1 else "")
        return (f"ZeRO-{self.zero} b={self.b}" + (f" tp={self.tp}" if self.tp > 1 else "") + pipe
                + (f" cp={self.cp}" + (" allgather" if self.cp_impl == "allgather" else "") if self.cp > 1 else "")
                + (f" ep={self.ep}" if self.ep > 1 else "") + (" --sp" if self.sp else "")
                + (" --recompute" if self.recompute else "") + (" --offload" if self.offload else "")
                + (f" --offload-ratio {self.ratio:g}" if self.offload and self.ratio < 1 else ""))

    def layout_kw(self) -> dict:
        """make_layout's arguments for this candidate's degrees and features."""
        pipe = dict(schedule=self.schedule, virtual=self.virtual) if self.pp > 1 else {}
        return dict(tp=self.tp, sp=self.sp, pp=self.pp, cp=self.cp, cp_impl=self.cp_impl, ep=self.ep, zero=self.zero,
                    recompute=self.recompute, offload="optimizer" if self.offload else None,
                    offload_ratio=self.ratio if self.offload and self.ratio < 1 else None, **pipe)


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
    lay = Candidate(1, kw.pop("zero", 0), b, kw.pop("recompute", False), tp, sp, **kw)
    return layout_of(s, lay, d, gpus) is not None


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
    if s.live:  # live recovery does not recover expert parallelism (live/trainer.py check_config)
        eps = (1,)
    E = s.cfg.moe_experts
    for dp, tp, sp, pipe, cp in meshes(s, tps, sps, pps, schedules, cps):
        if s.live and dp == 1:  # (one replica: any loss retires rank 0's, live/replicas.py)
            continue
        experts = [e for e in range(1, dp * cp + 1) if (dp * cp) % e == 0 and E % e == 0] if E else [1]
        for ep in [e for e in experts if eps is None or e in eps]:
            for zero in zeros if dp * cp > 1 or len(zeros) == 1 else (0,):  # one replica: nothing to shard
                for b in bs:
                    for rc in recomputes:
                        for impl in ("ring", "allgather") if cp > 1 else ("ring",):
                            lay = Candidate(dp, zero, b, rc, tp, sp, *pipe, cp=cp, cp_impl=impl, ep=ep)
                            if layout_of(s, lay, s.d) is not None:
                                yield lay


def candidate_of(lay) -> Candidate:
    """The planner's Candidate of a run's layout.Layout."""
    pipe = dict(schedule=lay.schedule, virtual=lay.virtual) if lay.pp > 1 else {}
    return Candidate(lay.dp, lay.zero, lay.batch.seqs_per_rank // lay.batch.micro_steps, lay.recompute, lay.tp, lay.sp,
                     lay.pp, cp=lay.cp, cp_impl=lay.cp_impl, ep=lay.ep, offload=lay.offload == "optimizer", **pipe)
