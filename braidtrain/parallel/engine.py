"""The engine: data parallelism and ZeRO 0-3 over flat buffers, driven by a schedule.

The protocol (docs/design-notes.md, "One validator, one table, one schedule"). The schedule decides
the order of work; the engine is told which micro-batch each forward and backward belongs to, and
which backward is the step's last:

    engine.begin_step(n_micro)
    with engine.forward(micro):  out = stage(x)           any order: 1F1B runs forward k+1
    engine.backward(micro, out, grad, last=...)           before backward k
    engine.finish_step()  ->  grad_norm()  ->  optimizer  ->  gather_params()

Reduction. Each parameter's post-accumulate-grad hook counts down its bucket (buckets.py); the
moment a bucket's last gradient of a backward is in, and that backward is the step's last, its
reduction over the bucket's group is launched asynchronously while the backward pass goes on
with earlier layers. ZeRO-0/1 accumulate micro-batches in the full gradient buffer and
communicate once. ZeRO-2/3 hold no full gradient buffer, so they reduce-scatter after every
backward from a bucket-sized scratch and add the result into the persistent shard: M times the
reduce-scatter traffic of ZeRO-1 for M micro-steps, against 4P(1 - 1/n) bytes of gradient memory
saved. (The other choice, accumulating locally and reducing once, needs the full gradient buffer
ZeRO-2 exists to remove.) Which gradient buffer lives when, and their pool: grads.py. Gradients
are *summed*: the loss was already divided by the global token count, once. In exact mode each
backward's gradient is a leaf of exact.py's tree, by micro-batch number: the order the backwards
ran in does not change a bit; an odd micro-batch's backward adds into its complete even sibling's
leaf, the tree's first level folded into the backward (exact.py; `fold`, on by default).

ZeRO-3 keeps a gathered bucket while an in-flight micro-batch still needs it (zero.py). A parameter
no backward reaches (its hook never runs) does not hold its bucket back: _without.

A lean state (`dtype` bf16 at ZeRO 1-3 or under `offload`: buckets.py's docstring). A block's
matrices compute in bf16 buckets, and the fp32 master of what this rank owns is the optimizer's
(owned() yields it; publish() writes it to the compute weights after the update). Their gradients
come from autograd in bf16, one backward of one parameter at a time, and the post-accumulate hook
adds each into the fp32 buffer (`main_grad`; a fresh buffer's first is written: grads.py) and drops
it: the bits autocast's cast of an fp32 weight gave, whose backward added the same bf16 gradient, made
fp32, into the fp32 .grad.

The stage asked for (`zero`) is the run's; each bucket runs the mechanics of its own, `b.zero`
(buckets.zero_stage): a reduce group of one rank has nothing to shard, so its buckets run stage 0's.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import partial

import torch

from braidtrain.collective.comm import Comm
from braidtrain.collective.flight import timing_events
from braidtrain.parallel import buckets, expert, master, norm, placement, zb
from braidtrain.parallel import exact as exact_sums
from braidtrain.parallel.buckets import Bucket
from braidtrain.parallel.grads import Grads
from braidtrain.parallel.tied import Tied
from braidtrain.parallel.zero import Zero


class Engine:
    """`parts`: the model, or the pipeline chunks this rank holds (model.GPT stages, in order)."""

    def __init__(self, parts, mesh, comm: Comm, *, zero: int, exact: bool, bucket_mb: float, device,
                 dtype=torch.float32, offload: bool = False, fold: bool = True):
        self.parts = parts if isinstance(parts, list) else [parts]
        self.model = self.parts[0]  # (its config is every part's)
        self.comm, self.zero, self.exact, self.device = comm, zero, exact, device
        self.fold = exact and fold  # exact mode: the tree's first level folded into the backward (exact.py)
        self.table = placement.build(self.parts)
        self.tp, self.pp, self.world = mesh.groups["tp"], mesh.groups["pp"], mesh.groups["world"]
        self.ep, self.p2p = mesh.groups["ep"], mesh.p2p  # ranks holding other experts (expert.py); pipeline pairs
        # Tensor parallelism: the tp ranks of one replica slot hold different shards of the sharded
        # parameters and identical copies of the replicated ones. The norm counts those copies
        # once (Table.counted_here); under sp their gradients are partial sums, added over tp.
        self.partial = self.table.sp_partial()
        named = {n: p for part in self.parts for n, p in part.named_parameters()}
        alone = Tied.kept_apart(self.table, exact)  # each in a bucket of its own (tied.py)
        formed = buckets.form(self.table, lambda e: named[e.name].numel(), bucket_mb, alone)
        # a lean state where the fp32 master need not be whole on the device (buckets.py): a sharded
        # optimizer's, or --offload optimizer's (`offload`: the optimizer will take the masters to the host)
        lean_where = lambda reduce: offload or buckets.zero_stage(zero, mesh.groups[reduce]) >= 1
        self.buckets = [Bucket(i, [(e.name, named[e.name]) for e in es], ms, mesh.groups[reduce], device,
                               min(zero, top), stage, [len(self.table.held(e)) for e in es], dt)  # (experts: slices)
                        for i, (es, ms, reduce, stage, dt, top) in enumerate(buckets.lean(formed, dtype, lean_where))]
        self.bucket_of = {}
        self.grads = Grads(self.buckets, device, exact)  # the gradient buffers' lifetime and their pool
        self.grads.sibling = self.sibling
        for b in self.buckets:
            master.lay_out(b, device)  # the values; a lean bucket's master apart
            for p, view in b.views(b.full):
                p.data = view  # the parameter now lives in the flat buffer
                self.bucket_of[p] = b
                p.register_post_accumulate_grad_hook(self._grad_ready)
                if b.zero <= 1 and not exact:
                    p.register_hook(partial(self.grads.first, b))
        self.trees = {b: exact_sums.TreeSum(self.grads.recycle) for b in self.buckets} if exact else {}
        self.scratch = ({b: torch.empty(b.padded, device=device) for b in self.buckets if b.group.size > 1} if exact
                        else {})
        self.pending: list = []  # ZeRO-2/3: reductions of earlier backwards still in flight
        self.last_grad_time = 0.0
        self._exposed = 0.0  # seconds, or a pair of CUDA events (see finish_step)
        self.n_micro, self.micro, self.last = 1, 0, True
        self.backward_phase = False  # inside backward(): forward hooks then see a recomputation
        self.input_only = False  # inside input_phase()
        self.tied = Tied(self)  # the tied embedding's two uses, kept apart (exact mode, pipelines)
        self.zero_hooks = Zero(self) if any(b.zero >= 2 for b in self.buckets) else None
        self.norm = (norm.ExactNorm if exact else norm.Norm)(self)
        self.sourced = expert.Sourced(self) if exact and self.ep.size > 1 else None  # experts' leaves by source
        self.updates = None  # --offload optimizer: the host's update, in flight into the next step (offload.py)
        for part in self.parts:
            part.use_expert_sink(self.sourced.add if self.sourced else None)

    # -- what the optimizer sees ---------------------------------------------------------------
    def owned(self):
        """(bucket, fp32 master shard, grad shard) this rank updates: whole buckets for ZeRO-0, its
        own shard of each bucket otherwise. The master is the compute weights themselves in an fp32
        bucket, a tensor of its own in a lean one (then publish() follows the update)."""
        for b in self.buckets:
            if b.zero == 0:
                yield b, b.master, b.grad
            elif b.zero == 1:  # (no gradient outside a step: grads.first)
                yield b, b.master, None if b.grad is None else b.grad[b.lo : b.hi]
            else:
                yield b, b.master, b.shard_grad

    def owned_range(self, b) -> tuple[int, int]:
        """The bucket positions [lo, hi) whose optimizer state this rank holds."""
        return b.owned_range()

    def publish(self, buckets) -> None:
        """After the optimizer's update of these buckets' masters: the compute weights of what this
        rank owns follow (bf16: rounded to nearest even); ZeRO-1/2's gather_params then brings the rest."""
        master.publish(buckets)

    def master_whole(self, b) -> torch.Tensor:
        """Bucket b's whole fp32 master, on the device (master.whole)."""
        return master.whole(b, self.comm, self.device)

    def segments(self, b, keep, span=None) -> list[tuple[int, int]]:
        """Ranges, relative to what this rank owns of bucket b (or to `span`, other positions
        [lo, hi) of it), of the parameters keep(placed) selects."""
        lo, hi = span or self.owned_range(b)
        out = []
        for (name, _), off, span in zip(b.params, b.offsets, b.spans):
            a, e = max(off, lo), min(off + span, hi)
            if keep(self.table[name]) and a < e:
                out.append((a - lo, e - lo))
        return out

    def decay_segments(self, b, span=None) -> list[tuple[int, int]]:
        """Where weight decay applies (Placed.decays: 2-D weights)."""
        return self.segments(b, lambda e: e.decays, span)

    # -- the step protocol ----------------------------------------------------------------------
    def begin_step(self, n_micro: int) -> None:
        """A new step of n_micro micro-batches on this stage. Also clears what a step that
        failed part-way may have left: open buffers, partial sums, a buffer pooled twice."""
        self.n_micro = n_micro
        self.tied.begin_step()
        if self.sourced:
            self.sourced.clear()
        for b in self.buckets:
            b.first, b.open = True, False
            if self.exact:
                self.trees[b].clear()
                if b.grad is not None:  # last step's gradient goes back to the pool
                    self.grads.recycle(b.grad)
                    b.grad = None
            # (ZeRO-0/1 accumulate the step's micro-batches in place, in a buffer opened by the step's
            # first gradient of the bucket: grads.first)
        if self.updates is not None:  # (--offload optimizer: offload.py)
            self.updates.begin_step()

    @contextmanager
    def forward(self, micro: int):
        """Around the forward of micro-batch `micro` (ZeRO-3: its gathers). Which micro-batch it is
        changes nothing today; a backward's number places its gradient in exact mode's tree."""
        self.backward_phase = False
        if self.zero_hooks is not None:
            self.zero_hooks.before_forward()
        yield

    def backward(self, micro: int, tensors, grads=None, last: bool = False, stage: int = 0) -> None:
        """The backward of micro-batch `micro` through chunk `stage` from `tensors` (the loss, or
        the chunk's outputs with their gradients `grads`); `last`: no other backward of this chunk
        follows in this step, so each of its buckets' reduction starts as its gradients complete."""
        self._backward(micro, last, stage, lambda: torch.autograd.backward(tensors, grads))

    def backward_weight(self, micro: int, weights, last: bool = False, stage: int = 0) -> None:
        """zb's W: the weight gradients of a backward whose input gradient input_phase() took
        (parallel/zb.py); otherwise as backward()."""
        self._backward(micro, last, stage, lambda: zb.backward_weight(weights), open_blocks=True)

    @contextmanager
    def input_phase(self):
        """zb's B: autograd computes a chunk input's gradient alone; no parameter's gradient
        arrives (the buckets wait for W, which opens them)."""
        self.backward_phase = self.input_only = True
        try:
            yield
        finally:
            self.backward_phase = self.input_only = False

    def _backward(self, micro, last, stage, work, open_blocks=False):
        self.micro, self.last = micro, last
        if self.updates is not None:  # the last step's update has every gradient before one is written
            self.updates.wait()
        if not self.comm.cuda:  # ZeRO-2/3: the last backward's reduce-scatters, so that their scratch is
            self._drain()  # free and each shard adds them in order (on CUDA the side stream runs them in order)
        for b in self.buckets:
            if b.stage != stage:
                continue
            b.pending, b.open = len(b.params), False  # (a backward that raised may have left them)
            if b.sourced:  # (its gradients come by expert.Sourced)
                continue
            # a fresh buffer for this backward
            if (self.exact and b.zero <= 1) or (open_blocks and b.zero >= 2 and b.modules):
                self.grads.open(b)  # (else ZeRO-2/3's zero.py opens it as the backward reaches it)
        self.backward_phase = True
        try:
            work()
        finally:
            self.backward_phase = False
        for b in self.buckets:  # parameters whose hook never ran: not in this backward's graph
            if b.stage == stage and b.pending and not b.sourced:
                self._without(b)

    def _without(self, b):
        """The backward is over, and parameters of bucket b got no gradient (not in its graph): b completes
        without them, opened first if nothing reached it; their views hold zeros or the step's earlier sum
        (ZeRO-2/3: dropped, or they would keep the scratch handed to the reduce-scatter alive)."""
        if b.zero <= 1 and not self.exact:
            self.grads.first(b, None)  # (the step's buffer, if no gradient opened it yet)
        elif not b.open:
            self.grads.open(b)
        b.pending = 0
        self._complete(b)
        for _, q in b.params if b.zero >= 2 else ():
            q.grad = q.main_grad = None

    def _grad_ready(self, p):
        b = self.bucket_of[p]
        if b.sourced:  # (autograd runs the hook with no gradient: expert.Tap gave it to Sourced)
            p.grad = None
            return
        if b.zero >= 2 and not b.open:  # autograd kept the gradient as a tensor of its own, lost here
            raise RuntimeError(f"ZeRO-{b.zero}: a gradient of bucket {b.index} arrived before its buffer was "
                               "opened (the hook that opens it did not run first)")
        if b.lean or b.unwritten is not None:  # a lean bucket's gradient added, or a first one written
            self.grads.arrived(b, p)  # (grads.py: "Written, not added")
        if b.lean:
            p.grad = None
            if b.zero >= 2:  # the view would keep that buffer alive
                p.main_grad = None
        elif b.zero >= 2:  # the gradient is in b.grad; the view would keep that buffer alive
            p.grad = None
        b.pending -= 1
        if not b.pending:
            self._complete(b)

    def _complete(self, b):
        """Bucket b's gradients of this backward are in: exact mode's tree, the reduction (ZeRO-2/3: each time)."""
        self.grads.written(b)
        b.open = False
        self.last_grad_time = time.time()
        if self.exact:
            self.trees[b].add(self.micro, b.grad)
            b.grad = None
            if self.last:
                b.grad = self.trees[b].total(self.n_micro)
                b.handle = self.exact_reduce(b, b.grad, *self.owned_grad(b), self.scratch.get(b))
                self.tied.reduced(b)
        elif b.zero <= 1:
            if self.last:
                self._launch(b)
        else:
            self._launch_every_backward(b)
        if self.zero_hooks is not None:
            self.zero_hooks.gradients_done(b)

    def sibling(self, b):
        """The complete even sibling leaf of bucket b that this (odd) backward adds into, or None:
        a buffer of its own (exact.py, the first level folded; grads.open asks)."""
        return self.trees[b].sibling(self.micro) if self.fold else None

    def owned_grad(self, b):
        """(where a reduction of bucket b leaves this rank's part, and whether that is the full
        bucket, rebuilt from its shards: ZeRO-0)."""
        if b.zero == 0:
            return b.grad, True
        return (b.grad[b.lo : b.hi] if b.zero == 1 else b.shard_grad), False

    def _launch(self, b):
        if b.zero == 0:
            b.handle = self.comm.all_reduce(b.grad, b.group)
        else:  # in place: this rank's shard of b.grad receives the sum
            b.handle = self.comm.reduce_scatter(b.grad[b.lo : b.hi], b.grad, b.group)

    def _launch_every_backward(self, b):
        scratch, first, b.grad, b.first = b.grad, b.first, None, False

        def accumulate(b=b, scratch=scratch, first=first):
            src = scratch[b.lo : b.hi]
            b.shard_grad.copy_(src) if first else b.shard_grad.add_(src)

        self.pending.append(self.comm.reduce_scatter(scratch[b.lo : b.hi], scratch, b.group, then=accumulate))
        # Free each scratch as soon as its collective has consumed it, not at the end of the
        # backward: on CUDA the allocator may reuse it once the side stream is past this point;
        # on a host backend, finish whatever collectives have already completed.
        if scratch.is_cuda and b.group.pg is not None:
            scratch.record_stream(self.comm.side)
        else:  # (one rank: the accumulation is done at once)
            done = [h for h in self.pending if h.ready()]
            for h in done:
                h.wait()
            self.pending = [h for h in self.pending if not h.done]

    def exact_reduce(self, b, grad, out, full, scratch):
        """Exact mode's reduction of a whole gradient `grad` laid out as bucket b (its own, or the
        tied head's): this rank's shard summed into `out` -- or, `full`, into grad[lo:hi], the full
        bucket then rebuilt from the reduced shards."""
        if not full:
            return self.comm.exact_reduce_scatter(out, grad, scratch, b.group)
        h = self.comm.exact_reduce_scatter(grad[b.lo : b.hi], grad, scratch, b.group)
        if b.group.size > 1:
            h = exact_sums.Then(h, lambda: self.comm.all_gather(grad, grad[b.lo : b.hi], b.group).wait())
        return h

    def _drain(self):
        for h in self.pending:
            h.wait()
        self.pending = []

    def finish_step(self) -> None:
        """Wait for every bucket's reduction (on CUDA: make the compute stream wait for it).
        The time this exposes -- how long the step waited after its backward pass -- is taken
        here, by host clock or by a pair of CUDA events, and read by exposed_comm_s()."""
        cuda = self.device.type == "cuda"
        if cuda:  # inside a graph capture, events that every replay records (comm.timing_events)
            self._exposed = timing_events()
            self._exposed[0].record()
        start = time.time()
        self._drain()
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
        self.tied.combine()  # the tied embedding's two uses, each reduced, added
        if self.partial:
            norm.sum_partials_over_tp(self)
        if cuda:
            self._exposed[1].record()
        else:
            self._exposed = time.time() - start
        if self.updates is not None:  # the first gradients go down to the host before the norm
            self.updates.start()

    def exposed_comm_s(self) -> float:
        """Seconds of the last finish_step(); on CUDA, call once the step's work is done."""
        if isinstance(self._exposed, tuple):
            return self._exposed[0].elapsed_time(self._exposed[1]) / 1000.0
        return self._exposed

    @contextmanager
    def gathered(self):
        """Every parameter present in full (ZeRO-3) and updated (--offload): for evaluation,
        sampling, hashing, export."""
        if self.updates is not None:
            self.updates.wait()
        if self.zero_hooks is None:
            yield
            return
        with self.zero_hooks.gathered():
            yield

    # -- gradient norm and the parameter all-gather --------------------------------------------
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the reduced gradient, each parameter counted once: a 0-dim tensor on
        the device (reading it is the caller's host synchronisation). parallel/norm.py."""
        return self.norm()

    def gather_params(self):
        """ZeRO-1/2: every rank updated its shard; the all-gathers (in place) bring them together.
        ZeRO-3 gathers lazily, bucket by bucket, in the next forward pass; so does --offload, each
        hosted bucket once its update has landed (offload.py)."""
        handles = [self.comm.all_gather(b.data, b.data[b.lo : b.hi], b.group) for b in self.buckets
                   if b.zero in (1, 2) and not b.hosted]
        self.grads.drop()  # (the host's update holds its own references until each has come down)
        for h in handles:
            h.wait()

    def laid_out_again(self) -> None:
        """Live recovery re-laid the buckets out over another group (Bucket.relayout): the buffers
        sized by their padding, afresh."""
        self.pending = []
        self.grads.reset()
        if self.exact:
            self.scratch = {b: torch.empty(b.padded, device=self.device) for b in self.buckets if b.group.size > 1}
            self.norm = norm.ExactNorm(self)
            self.tied.laid_out_again()

    def model_state_bytes(self) -> int:
        """Bytes of compute weights, fp32 masters kept apart on the device, and gradients held in
        this rank's flat buffers (now)."""
        return master.state_bytes(self.buckets)
