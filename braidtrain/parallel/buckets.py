"""Flat buffers and buckets: where a stage's parameters and gradients live, and how they shard.

A stage's parameters become views into flat buffers, one per *bucket*: runs of whole units
(a transformer block; the embedding group wte + wpe + ln_f) of about `bucket_mb`, formed per
reduce group (the placement table's `reduce`: the group that sums the gradient) from the last
block backwards -- the order the backward pass produces gradients -- and never depending on the
world size. Each parameter starts at a multiple of Q = 64 elements (zeros between), and each
bucket is padded with zeros to a multiple of n * Q (n = its group's size), so it splits into n
equal, 256-byte aligned shards, and every Q-chunk of a shard lies in one parameter -- at the same
place in it whatever the layout (exact mode's gradient norm sums such chunks, parallel/exact.py).
A stack of experts (placement.py) is laid out as its experts one after another, each slice starting
at a multiple of Q too (zeros between, where a slice is not a multiple of Q: the parameter is then a
strided view), so that a slice's chunks are the same whichever experts an ep rank holds:

      bucket k (padded):  [ shard 0 | shard 1 | ... | shard n-1 ]
                            rank 0    rank 1          rank n-1

  what a rank holds   compute weights     fp32 master     grads (fp32)          Adam m, v (fp32)
  ZeRO-0              full                full            full                  full
  ZeRO-1              full                its shard       full (reduce-scatter  its shard
                                                          in place, keeps shard)
  ZeRO-2              full                its shard       its shard (+ scratch) its shard
  ZeRO-3              its shard (+ the    its shard       its shard (+ scratch) its shard
                      gathered buckets in use)

A lean state (bf16 runs: the engine's `dtype`, where the fp32 master need not be whole on the device:
at ZeRO 1-3 over more than one rank, and under --offload optimizer, whose master is on the host; at
ZeRO-0 a bf16 copy beside the whole fp32 master would cost 2 bytes a parameter more than fp32 weights
and their autocast casts, which --recompute frees block by block -- so ZeRO-0 keeps fp32 buckets).
A bucket's compute weights have one dtype, `dtype`:
a block bucket's matrices (every use a matmul that autocast runs in bf16) are bf16, and the fp32
master of what the rank owns is a tensor of its own, `master`, which the optimizer updates and then
writes to the compute weights (Engine.publish), rounded to nearest even -- the bf16 values autocast's
cast of an fp32 weight gives, so the forward computes with the same numbers as with fp32 weights. A
bf16 parameter's gradient is added by a hook into the fp32 gradient buffer (`main_grad`, as
Megatron-LM's), as autocast's cast's backward added it (a fresh buffer's first: written, grads.py).
(Under --fp8 the float8 matmul's fp32 weight gradient is rounded to the parameter's bf16 by autograd
before the hook adds it: over fp32 weights it was not.) Everything else stays fp32, and then the
bucket IS the master (`master` a view of `data`: no second copy): 1-D parameters (norms, biases:
small; autocast computes with them in fp32) in buckets of their own beside their block's, which run
at most ZeRO-2's mechanics (whole on every rank, so that the gathered bf16 buckets never carry fp32);
the embedding group (autocast does not cast a lookup: a bf16 table would change the model's
function) and a last stage's head (its gradient is scaled in fp32, model/loss.py). Bytes a
parameter, bf16 matrices: 2 + 4 + 12/n at ZeRO-1 (Megatron-LM's distributed optimizer), 2 + 16/n
at ZeRO-2 and (2 + 16)/n at ZeRO-3 (plus the scratch and gathered buckets in use); fp32 ones
4 + 4 + 8/n, 4 + 12/n, 16/n. In fp32 runs every bucket is fp32: 4 + 4 + 8/n at ZeRO-1.

A reduce group of one rank has nothing to shard: its buckets run stage 0's mechanics whatever
stage the run asked for (`zero_stage`): no gathers, no shard copies, no gradient scratch, so ZeRO-2/3
on one rank hold and move what ZeRO-0 does. Shard and bucket are then the same elements, so what
the optimizer updates and a checkpoint saves is the same too (the run still reports, and records,
the stage asked for).
"""

from __future__ import annotations

import math

import torch

Q = 64  # shard quantum (elements): alignment, and the chunk of the exact gradient norm


def stride(numel: int, slices: int) -> int:
    """Elements from one slice's start to the next of a parameter of `slices` slices (1: its numel)."""
    return numel if slices == 1 else math.ceil(numel // slices / Q) * Q


def span(numel: int, slices: int) -> int:
    """Elements from a parameter's start to its end in a bucket (its slices' gaps included)."""
    return stride(numel, slices) * (slices - 1) + numel // slices


def place(numels: list[int], slices: list[int] | None = None) -> tuple[list[int], int]:
    """The offsets of parameters of these sizes (each of these slices: default 1) in a bucket (each a
    multiple of Q), and the end of the last: what the bucket holds before its padding to n * Q."""
    spans = [span(k, n) for k, n in zip(numels, slices or [1] * len(numels))]
    offsets, off = [], 0
    for k in spans:
        offsets.append(off)
        off = math.ceil((off + k) / Q) * Q
    return offsets, (offsets[-1] + spans[-1] if spans else 0)


def zero_stage(zero: int, group) -> int:
    """The ZeRO stage whose mechanics a bucket reduced over `group` runs: 0 on a group of one rank."""
    return zero if group.size > 1 else 0


class Bucket:
    def __init__(self, index, params, modules, group, device, zero, stage=0, slices=None, dtype=torch.float32):
        self.index, self.params, self.modules, self.group = index, params, modules, group  # params: [(name, param)]
        self.stage = stage  # the pipeline chunk whose parameters it holds
        self.zero = zero = zero_stage(zero, group)  # the mechanics this bucket runs
        self.dtype, self.lean = dtype, dtype != torch.float32  # the compute weights' dtype (module docstring)
        self.apart = self.lean  # the fp32 master is a tensor of its own (lean; --offload's on the host)
        self.hosted = False  # that tensor is --offload's, in host memory (offload.py sets it)
        self.slices = slices or [1] * len(params)  # per parameter: its experts (a stack), else 1
        self.offsets, self.numel = place([p.numel() for _, p in params], self.slices)
        self.spans = [span(p.numel(), k) for (_, p), k in zip(params, self.slices)]
        self.shape(group.size, group.index)
        # ZeRO-3: `data` is the shard and `full` the gathered bucket; otherwise `data` is full
        self.data = torch.zeros(self.shard_size if zero == 3 else self.padded, dtype=dtype, device=device)
        self.full = torch.zeros(self.padded, dtype=dtype, device=device) if zero == 3 else self.data
        self.master = None if self.apart else self.compute_shard()  # (apart: Engine sets it)
        self.grad = None  # ZeRO-0/1: the step's full gradient, from its first gradient to its update (Engine)
        self.shard_grad = torch.zeros(self.shard_size, device=device) if zero >= 2 else None
        self.pending = 0  # gradients still to come in this backward
        self.open = False  # this backward's gradient buffer is open (grads.Grads.open; ZeRO-2/3 check it)
        self.unwritten = None  # {param: view} its gradient is still to be written into (grads.py), or None: added
        self.first = True  # ZeRO-2/3: the step's first reduce-scatter copies, later ones add; ZeRO-0/1: opens b.grad
        self.handle = None  # the reduction in flight
        self.gathered, self.gather_handle = True, None  # ZeRO-3
        self.needs_full = True  # ZeRO-3: a backward of this bucket reads the gathered buffer
        self.sourced = False  # exact mode at ep > 1: its gradients come by expert.Sourced, not autograd
        self.small = {off: p.numel() for (_, p), off in zip(params, self.offsets) if p.dim() == 1}  # 1-D params

    def shape(self, n: int, index: int) -> None:
        """The padding over a group of n ranks, and the shard [lo, hi) of the one at `index`."""
        self.padded = math.ceil(self.numel / (n * Q)) * n * Q
        self.shard_size = self.padded // n
        self.lo, self.hi = index * self.shard_size, (index + 1) * self.shard_size

    def owned_range(self) -> tuple[int, int]:
        """The bucket positions [lo, hi) whose master and optimizer state this rank holds."""
        return (0, self.padded) if self.zero == 0 else (self.lo, self.hi)

    def compute_shard(self) -> torch.Tensor:
        """The compute weights of the positions this rank owns (what the optimizer's update writes)."""
        return self.data if self.zero in (0, 3) else self.data[self.lo : self.hi]

    def relayout(self, group, params: torch.Tensor) -> None:
        """Live recovery's re-shard (parallel/mirror.py): the bucket laid out over `group` as a run
        started on it would lay it out -- new buffers, the parameters pointed into them, their
        values from `params` (the whole bucket's fp32 master, at least numel long)."""
        self.group = group
        self.shape(group.size, group.index)
        master = torch.zeros(self.padded, device=params.device)
        master[: self.numel] = params[: self.numel]
        whole = master.to(self.dtype) if self.lean else master
        for p, view in self.views(whole):
            p.data = view
        self.full = whole
        self.data = whole[self.lo : self.hi].clone() if self.zero == 3 else whole
        lo, hi = self.owned_range()
        self.master = master[lo:hi].clone() if self.apart else self.compute_shard()
        if self.zero == 3:  # released: gathered when a forward needs it (zero.py)
            whole.untyped_storage().resize_(0)
        self.gathered, self.gather_handle, self.handle = self.zero != 3, None, None
        self.grad, self.unwritten = None, None
        self.shard_grad = torch.zeros(self.shard_size, device=params.device) if self.zero >= 2 else None

    def view(self, buf, i: int) -> torch.Tensor:
        """Parameter i's place in buf (a bucket-sized buffer), shaped as the parameter."""
        (_, p), off, k = self.params[i], self.offsets[i], self.slices[i]
        if self.spans[i] == p.numel():
            return buf[off : off + p.numel()].view_as(p)
        inner = [math.prod(p.shape[d + 1:]) for d in range(1, p.dim())]  # each slice contiguous
        return buf[off : off + self.spans[i]].as_strided(p.shape, (stride(p.numel(), k), *inner))

    def views(self, buf):
        for i, (_, p) in enumerate(self.params):
            yield p, self.view(buf, i)

    def runs(self, i: int) -> list[tuple[int, int, int]]:
        """(element of parameter i, bucket position, length) of each contiguous run of it."""
        (_, p), off, k = self.params[i], self.offsets[i], self.slices[i]
        if self.spans[i] == p.numel():
            return [(0, off, p.numel())]
        n, step = p.numel() // k, stride(p.numel(), k)
        return [(j * n, off + j * step, n) for j in range(k)]


def form(table, numel, bucket_mb: float, alone=frozenset()) -> list[tuple[list, list, str, int]]:
    """(placed parameters, block modules, reduce group, pipeline chunk) of each bucket, in launch
    order: per chunk (the last first) and reduce group, whole units from the last backwards until
    a bucket holds >= bucket_mb; a unit of no block -- the embedding group, used at both ends so
    that its gradient is complete last; a last stage's ln_f and head -- a bucket of its own.
    A parameter named in `alone` is a bucket by itself (the tied embedding, whose two uses' reduced
    gradients are added shard by shard: parallel/tied.py). `numel(e)`: the elements this rank holds
    of placed parameter e (the engine's tensors; the planner's sizes)."""
    limit = max(1, int(bucket_mb * 2**20 / 4))
    out = []
    for stage in sorted({e.stage for e in table}, reverse=True):
        for reduce in dict.fromkeys(e.reduce for e in table):
            cur, mods, size = [], [], 0
            for module, entries in reversed(table.units):  # last block first: the backward's order
                mine = [e for e in entries if e.reduce == reduce and e.stage == stage]
                if not mine:
                    continue
                if module is None:  # a unit of no block is a bucket of its own
                    out += [(cur, mods, reduce, stage)] if cur else []
                    rest = [e for e in mine if e.name not in alone]
                    out += [(rest, [], reduce, stage)] if rest else []
                    out += [([e], [], reduce, stage) for e in mine if e.name in alone]
                    cur, mods, size = [], [], 0
                    continue
                cur, mods, size = mine + cur, [module] + mods, size + sum(numel(e) for e in mine)
                if size >= limit:
                    out.append((cur, mods, reduce, stage))
                    cur, mods, size = [], [], 0
            out += [(cur, mods, reduce, stage)] if cur else []
    return out


def lean(formed, dtype, where=lambda reduce: True) -> list[tuple[list, list, str, int, torch.dtype, int]]:
    """form()'s buckets, each with its compute dtype: in a bf16 run (`dtype`) a block bucket's matrices
    (Placed.decays: 2-D weights, an expert's slices) in bf16 and its 1-D parameters in an fp32 bucket
    beside it -- where `where(reduce group)` (the engine: where the master need not be whole on the
    device); buckets of no block (the embedding group, a last stage's head) fp32 (module docstring).
    In an fp32 run every bucket is fp32, as formed. Last: the highest ZeRO stage whose mechanics the
    bucket runs (the 1-D parameters' buckets stay whole: ZeRO-2's, so no gathered bf16 bucket carries
    fp32 elements)."""
    out = []
    for es, mods, reduce, stage in formed:
        if dtype == torch.float32 or not mods or not where(reduce):
            out.append((es, mods, reduce, stage, torch.float32, 3))
            continue
        matrices, small = [e for e in es if e.decays], [e for e in es if not e.decays]
        out += [(matrices, mods, reduce, stage, dtype, 3)] if matrices else []
        out += [(small, mods, reduce, stage, torch.float32, 2)] if small else []
    return out
