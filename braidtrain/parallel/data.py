"""Data parallelism and ZeRO 0-3 over flat buffers: the one place where gradients are reduced.

Layout. A model stage's parameters become views into flat fp32 buffers, one per *bucket*: runs of
whole units (a transformer block; the embedding group wte + wpe + ln_f) of about `bucket_mb`,
formed from the last block backwards (the order the backward pass produces gradients) and not
depending on the world size. Each bucket is padded with zeros to a multiple of n * Q (n = replica-
group size, Q = 64 elements), so it splits into n equal, 256-byte aligned shards:

      bucket k (padded):  [ shard 0 | shard 1 | ... | shard n-1 ]
                            rank 0    rank 1          rank n-1

  what a rank holds      params        grads                   Adam m, v
  ZeRO-0                 full          full                    full
  ZeRO-1                 full          full (reduce-scatter    its shard
                                       in place, keeps shard)
  ZeRO-2                 full          its shard               its shard
  ZeRO-3                 its shard     its shard               its shard
                         (+ gathered buckets in use)

Reduction. Each parameter's post-accumulate-grad hook counts down its bucket; the moment a
bucket's last gradient is in, its reduction is launched asynchronously while the backward pass
goes on with earlier layers. ZeRO-0/1 accumulate micro-batches in the full gradient buffer and
communicate only on the final micro-step. ZeRO-2/3 hold no full gradient buffer, so they reduce-
scatter every micro-step from a bucket-sized scratch -- opened as the backward reaches the bucket,
the parameters' .grad views into it so that autograd adds into it in place, and freed as soon as
the collective has read it -- and add the result into the persistent shard: M times the reduce-
scatter traffic of ZeRO-1 for M micro-steps, against 4P(1 - 1/n) bytes of gradient memory saved.
(The other choice, accumulating locally and reducing once, needs the full gradient buffer ZeRO-2
exists to remove.)
Gradients are *summed*: the loss was already divided by the global token count, once.

Exact mode (DESIGN.md, "Exact reduction"). Each micro-step's gradient lands in a fresh full-size
buffer and is folded into a binary counter (slot k holds the sum of 2^k micro-batches), so a
rank's m = 2^j micro-batches are summed along a complete binary tree; the all-to-all + pairwise-
sum reduce-scatter (comm.exact_reduce_scatter) then adds the dp subtrees along the same tree.
Any power-of-two dp gives the one tree over all micro-batches, hence the same bits -- at every
ZeRO stage, which in exact mode therefore also holds the local tree (log2(m) + 1 full buffers).
The gradient norm is summed in float64 over fixed Q-element chunks with pairwise trees, so it
does not depend on where shard boundaries fall.

ZeRO-3 parameters. A bucket's full buffer exists only while gathered: its storage is resized to
zero when released and back when gathered, so the parameters (views into it) and the tensors
autograd saved for backward stay valid objects. Block buckets are gathered by a forward pre-hook
(which also prefetches the next bucket) and released after their forward. The backward pass gathers
a bucket again only if it reads it: while a block runs forward, a saved-tensor hook looks at what
autograd keeps for its backward -- a 1-D parameter (a LayerNorm's weight, a bias) is kept as a
copy; a weight itself (fp32 compute) marks the bucket, and a hook on the bucket's output gathers
it again for the backward (and prefetches the previous one). Where other code's saved-tensor hooks
are active (--recompute's checkpoint, whose backward runs the block's forward again; save_on_cpu)
every block is marked. Buckets are released once their gradients are reduced. Under bf16 autocast
the backward needs only the bf16 copies of the weights that the forward saved, so a step gathers
each block once a micro-step, not twice. (A block that checkpoints part of itself would recompute
that part from released parameters -- an error, not wrong numbers; --recompute checkpoints whole
blocks.) Between the micro-steps of a step the parameters do not change, so the embedding group
(wte, tied to the head, wpe, ln_f; used at both ends of the model, so gathered for nearly all of
every micro-step anyway) stays gathered from the step's first micro-step to the gradients of its
last. The first block, released after its forward, is gathered again as the backward reaches the
block after it, the activations mostly freed by then, and kept for the next micro-step's forward,
which then starts with nothing to wait for. (If all blocks are one bucket, there is no block after
it: it is gathered at the micro-step's start.) After the last micro-step the optimizer changes the
parameters: both are released, and gathered afresh.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from functools import partial

import torch

from braidtrain.comm import Comm, pairwise_sum, timing_events

Q = 64  # shard quantum (elements): alignment, and the chunk of the exact gradient norm


class Bucket:
    def __init__(self, index, params, modules, n_shards, rank, device, zero):
        self.index, self.params, self.modules = index, params, modules  # params: [(name, param)]
        self.numel = sum(p.numel() for _, p in params)
        self.padded = math.ceil(self.numel / (n_shards * Q)) * n_shards * Q
        self.shard_size = self.padded // n_shards
        self.lo, self.hi = rank * self.shard_size, (rank + 1) * self.shard_size
        self.offsets, off = [], 0
        for _, p in params:
            self.offsets.append(off)
            off += p.numel()
        # ZeRO-3: `data` is the shard and `full` the gathered bucket; otherwise `data` is full
        self.data = torch.zeros(self.shard_size if zero == 3 else self.padded, device=device)
        self.full = torch.zeros(self.padded, device=device) if zero == 3 else self.data
        self.grad = torch.zeros(self.padded, device=device) if zero <= 1 else None
        self.shard_grad = torch.zeros(self.shard_size, device=device) if zero >= 2 else None
        self.pending = 0
        self.open = False  # this micro-step's gradient buffer is open (_open_grad; ZeRO-2/3 check it)
        self.first = True  # ZeRO-2/3: the step's first reduce-scatter copies, later ones add
        self.handle = None  # the reduction in flight
        self.gathered, self.gather_handle = True, None  # ZeRO-3
        self.needs_full = True  # ZeRO-3: this micro-step's backward reads the gathered buffer
        self.small = {off: p.numel() for (_, p), off in zip(params, self.offsets) if p.dim() == 1}  # 1-D params
        self.slots: dict[int, torch.Tensor] = {}  # exact mode: level -> partial sum of 2^level micro-batches

    def views(self, buf):
        for (_, p), off in zip(self.params, self.offsets):
            yield p, buf[off : off + p.numel()].view_as(p)


def units(model):
    """(module, [(name, param)]) groups that are gathered and reduced together, in forward order:
    the model's own (GPT.param_units: the embedding group, with module None, then each block),
    else the whole model as one group."""
    named = dict(model.named_parameters())
    if hasattr(model, "param_units"):
        return [(mod, [(n, named[n]) for n in names]) for mod, names in model.param_units()]
    return [(None, list(named.items()))]


class DataParallel:
    def __init__(self, model, mesh, comm: Comm, *, zero: int, exact: bool, bucket_mb: float, device):
        self.model, self.comm, self.zero, self.exact, self.device = model, comm, zero, exact, device
        self.group = mesh.groups["replica"]
        self.n = mesh.size("replica")
        self.rank = mesh.ranks["replica"].index(mesh.rank)
        # Tensor parallelism: the tp ranks of one replica slot hold different shards of the
        # sharded parameters and identical copies of the replicated ones (LayerNorms, wpe, the
        # row-parallel biases). The norm counts those copies once (tp rank 0's); under sp their
        # gradients are partial sums over this rank's part of the sequence, added over tp.
        self.tp_group, self.tp = mesh.groups["tp"], mesh.size("tp")
        self.tp_rank = mesh.coord("tp")
        spec = getattr(model, "shard_spec", None)
        self.replicated = {n for n, _ in model.named_parameters() if self.tp > 1 and spec(n).kind == "replicated"}
        self.partial = set(model.tp_partial_grads()) if self.tp > 1 and hasattr(model, "tp_partial_grads") else set()
        limit = max(1, int(bucket_mb * 2**20 / 4))
        groups, cur, mods, size = [], [], [], 0  # groups: (params, modules), in backward order
        for mod, params in reversed(units(model)):  # last block first: the backward's order
            if mod is None:  # the embedding group (used at both ends) is a bucket of its own
                groups += [(cur, mods)] if cur else []
                groups.append((params, []))
                cur, mods, size = [], [], 0
                continue
            cur, mods, size = params + cur, [mod] + mods, size + sum(p.numel() for _, p in params)
            if size >= limit:
                groups.append((cur, mods))
                cur, mods, size = [], [], 0
        groups += [(cur, mods)] if cur else []
        self.buckets = [Bucket(i, g, ms, self.n, self.rank, device, zero) for i, (g, ms) in enumerate(groups)]
        self.bucket_of = {}
        for b in self.buckets:
            for p, view in b.views(b.full):
                view.copy_(p.detach())
                p.data = view  # the parameter now lives in the flat buffer
                self.bucket_of[p] = b
                p.register_post_accumulate_grad_hook(self._grad_ready)
        self.scratch = [torch.empty(b.padded, device=device) for b in self.buckets] if exact and self.n > 1 else None
        self._pool: dict[int, list[torch.Tensor]] = {}
        self.pending: list = []  # ZeRO-2/3: reductions of earlier micro-steps still in flight
        self.last_grad_time = 0.0
        self._exposed = 0.0  # seconds, or a pair of CUDA events (see finish_reduction)
        self.backward_phase = False
        self.keep_gathered = False
        self._watch = None  # ZeRO-3: the saved-tensor hooks of the block running forward
        # ZeRO-3: gathered from one micro-step into the next (released after the step's last): the
        # embedding group, in use from a micro-step's start to its end anyway, and the first block,
        # gathered again near the end of the backward for the next forward
        blocks = [b for b in self.buckets if b.modules]
        self.kept = [self.buckets[-1]] + blocks[-1:] if zero == 3 else []
        if zero == 3:
            with torch.no_grad():
                for b in self.buckets:
                    b.data.copy_(b.full[b.lo : b.hi])
                    self._release(b)
        if zero >= 2:
            self._install_block_hooks()
            for b in self.buckets:  # buckets of no block: opened by the first of their gradients
                if not b.modules:
                    for _, p in b.params:
                        p.register_hook(partial(self._open_on_first_grad, b))

    # -- what the optimizer sees ---------------------------------------------------------------
    def owned(self):
        """(bucket, param shard, grad shard) this rank updates: whole buckets for ZeRO-0, its own
        shard of each bucket otherwise."""
        for b in self.buckets:
            if self.zero == 0:
                yield b, b.data, b.grad
            elif self.zero == 1:
                yield b, b.data[b.lo : b.hi], b.grad[b.lo : b.hi]
            else:
                yield b, b.data if self.zero == 3 else b.data[b.lo : b.hi], b.shard_grad

    def owned_range(self, b) -> tuple[int, int]:
        """The bucket positions [lo, hi) whose optimizer state this rank holds."""
        return (0, b.padded) if self.zero == 0 else (b.lo, b.hi)

    def segments(self, b, keep) -> list[tuple[int, int]]:
        """Ranges, relative to what this rank owns of bucket b, of the parameters keep(name, p) selects."""
        lo, hi = self.owned_range(b)
        out = []
        for (name, p), off in zip(b.params, b.offsets):
            a, e = max(off, lo), min(off + p.numel(), hi)
            if keep(name, p) and a < e:
                out.append((a - lo, e - lo))
        return out

    def decay_segments(self, b) -> list[tuple[int, int]]:
        """Where weight decay applies: 2-D weights."""
        return self.segments(b, lambda _n, p: p.dim() >= 2)

    # -- a micro-step ---------------------------------------------------------------------------
    def start_micro_step(self, micro: int, n_micro: int):
        self.last = micro == n_micro - 1
        self.backward_phase = False
        if not self.comm.cuda:  # ZeRO-2/3: last micro-step's reduce-scatters, so their scratch is free
            self._drain()  # (on CUDA the allocator holds it for the side stream: no need to wait)
        for b in self.buckets:
            b.pending, b.open = len(b.params), False  # (a backward that raised may have left them)
            if micro == 0:
                b.first = True
                b.slots.clear()  # exact: partial sums a step that failed part-way left behind
                if self.exact and b.grad is not None:  # last step's gradient goes back to the pool
                    pool = self._pool.setdefault(b.padded, [])
                    if all(g is not b.grad for g in pool):  # (a failed step may have put it there)
                        pool.append(b.grad)
                    b.grad = None
            # ZeRO-0/1: the full gradient buffer, fresh in exact mode (each micro-batch a leaf of the
            # tree); ZeRO-2/3 open a scratch as the backward reaches the bucket
            if self.zero <= 1 and (self.exact or micro == 0):
                self._open_grad(b, None if self.exact else b.grad)
        if self.zero == 3:
            self._gather(self.buckets[-1])  # the embedding group, needed first and last
            if len(self.buckets) > 1:
                self._gather(self.buckets[-2], wait=False)  # prefetch the first block

    def backward(self, loss):
        self.backward_phase = True
        loss.backward()

    def _open_grad(self, b, buf=None):
        """Zero the bucket's gradient buffer `buf` (None: a fresh one) and point its parameters'
        .grad at views into it: autograd then adds each gradient into it in place. ZeRO-2/3 open a
        scratch as the backward reaches the bucket (a hook on the gradient of its output, or of its
        parameters for a bucket of no block) and hand it to the reduce-scatter when it is complete.
        (Copying each gradient out in a hook instead cost the GPU machine's host 28-30 us a
        parameter, 33-36 ms a gpt2 ZeRO-3 step; the GPU now zeroes and adds: more bytes, less host
        time.)"""
        b.grad = buf if buf is not None else self._take(b.padded)
        b.grad.zero_()
        for p, view in b.views(b.grad):
            p.grad = view
        b.open = True

    def _open_on_first_grad(self, b, _grad):
        if not b.open:
            self._open_grad(b)

    def _take(self, n):
        pool = self._pool.setdefault(n, [])
        return pool.pop() if pool else torch.empty(n, device=self.device)

    def _grad_ready(self, p):
        b = self.bucket_of[p]
        if self.zero >= 2:  # the gradient is in b.grad; the view would keep that buffer alive
            if not b.open:  # autograd kept the gradient as a tensor of its own, lost here
                raise RuntimeError(f"ZeRO-{self.zero}: a gradient of bucket {b.index} arrived before its buffer was "
                                   "opened (the hook that opens it did not run first)")
            p.grad = None
        b.pending -= 1
        if b.pending:
            return
        b.open = False
        self.last_grad_time = time.time()
        if self.exact:
            self._fold(b)
            if self.last:
                self._launch_exact(b)
        elif self.zero <= 1:
            if self.last:
                self._launch(b)
        else:
            self._launch_every_micro_step(b)
        if self.zero == 3 and (self.last or b not in self.kept):
            self._release(b)

    def _fold(self, b):
        """Binary-counter accumulation: carry the new leaf up while its level is occupied."""
        carry, level = b.grad, 0
        while level in b.slots:
            left = b.slots.pop(level)
            left.add_(carry)  # IEEE addition is commutative: only the tree's shape matters
            self._pool.setdefault(carry.numel(), []).append(carry)
            carry, level = left, level + 1
        b.slots[level] = carry
        if self.last:
            # dp == 1 with any micro-step count: fold the remaining levels, smallest first
            while len(b.slots) > 1:
                part = b.slots.pop(min(b.slots))
                b.slots[min(b.slots)].add_(part)
                self._pool[part.numel()].append(part)
            b.grad = b.slots.pop(max(b.slots))

    def _launch(self, b):
        if self.zero == 0:
            b.handle = self.comm.all_reduce(b.grad, self.group, "replica")
        else:  # in place: this rank's shard of b.grad receives the sum
            b.handle = self.comm.reduce_scatter(b.grad[b.lo : b.hi], b.grad, self.group, "replica")

    def _launch_every_micro_step(self, b):
        scratch, first, b.grad, b.first = b.grad, b.first, None, False

        def accumulate(b=b, scratch=scratch, first=first):
            src = scratch[b.lo : b.hi]
            b.shard_grad.copy_(src) if first else b.shard_grad.add_(src)

        self.pending.append(self.comm.reduce_scatter(scratch[b.lo : b.hi], scratch, self.group, "replica", then=accumulate))
        # Free each scratch as soon as its collective has consumed it, not at the end of the
        # backward: on CUDA the allocator may reuse it once the side stream is past this point;
        # on a host backend, finish whatever collectives have already completed.
        if scratch.is_cuda and self.group is not None:
            scratch.record_stream(self.comm.side)
        else:  # (one rank: the accumulation is done at once)
            done = [h for h in self.pending if h.ready()]
            for h in done:
                h.wait()
            self.pending = [h for h in self.pending if not h.done]

    def _launch_exact(self, b):
        scratch = self.scratch[b.index] if self.scratch is not None else None
        if self.zero >= 2:
            b.handle = self.comm.exact_reduce_scatter(b.shard_grad, b.grad, scratch, self.group, "replica", self.n)
            return
        h = self.comm.exact_reduce_scatter(b.grad[b.lo : b.hi], b.grad, scratch, self.group, "replica", self.n)
        if self.zero == 0 and self.n > 1:  # rebuild the full gradient from the reduced shards
            h = _Then(h, lambda b=b: self.comm.all_gather(b.grad, b.grad[b.lo : b.hi], self.group, "replica").wait())
        b.handle = h

    def _drain(self):
        for h in self.pending:
            h.wait()
        self.pending = []

    def finish_reduction(self) -> None:
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
        if self.partial:
            self._sum_partials_over_tp()
        if cuda:
            self._exposed[1].record()
        else:
            self._exposed = time.time() - start

    def exposed_comm_s(self) -> float:
        """Seconds of the last finish_reduction(); on CUDA, call once the step's work is done."""
        if isinstance(self._exposed, tuple):
            return self._exposed[0].elapsed_time(self._exposed[1]) / 1000.0
        return self._exposed

    def _sum_partials_over_tp(self):
        """Add the sp-partial gradients over the tp ranks, packed into one message. A gather and
        a pairwise sum in tp-rank order rather than an all-reduce: the same bits on every rank."""
        owned = [(g, self.segments(b, lambda n, _p: n in self.partial)) for b, _, g in self.owned()]
        flat = torch.cat([g[a:e] for g, segs in owned for a, e in segs])
        rows = self.comm.gather_rows(flat, self.tp_group, "tp")
        total, pos = pairwise_sum(rows), 0
        for g, segs in owned:
            for a, e in segs:
                g[a:e].copy_(total[pos : pos + e - a])
                pos += e - a

    # -- ZeRO-3 parameter gathering -------------------------------------------------------------
    def _gather(self, b, wait=True):
        if not b.gathered and b.gather_handle is None:
            b.full.untyped_storage().resize_(b.padded * 4)
            b.gather_handle = self.comm.all_gather(b.full, b.data, self.group, "replica")
        if wait and b.gather_handle is not None:
            b.gather_handle.wait()
            b.gather_handle = None
            b.gathered = True

    def _release(self, b):
        if self.keep_gathered:
            return
        if b.gather_handle is not None:  # a gather in flight lands first: else it would land later,
            self._gather(b)  # with the values of before an optimizer step, into freed memory
        if not b.gathered:
            return
        b.full.untyped_storage().resize_(0)
        b.gathered = False

    def _install_block_hooks(self):
        """ZeRO-2/3: each block bucket's gradient buffer opens as the backward reaches it (a hook on
        its output's gradient). ZeRO-3 also gathers and releases the bucket around its forward and,
        where needed, gathers it again for the backward."""
        blocks = [b for b in self.buckets if b.modules]  # in backward order: last block first

        for k, b in enumerate(blocks):
            nxt = blocks[k - 1] if k > 0 else None  # the next bucket in forward order
            prev = blocks[k + 1] if k + 1 < len(blocks) else None  # the next one in backward order

            def pre(_mod, _args, b=b, nxt=nxt):
                self._gather(b)
                if self.backward_phase or not torch.is_grad_enabled():
                    return  # a recomputation inside the backward, or evaluation
                if nxt is not None:
                    self._gather(nxt, wait=False)
                self._stop_watching()  # left over from a forward that raised
                # Other code's saved-tensor hooks (torch.utils.checkpoint's under --recompute, whose
                # backward runs the forward again; save_on_cpu): ours would hide theirs. Gather again.
                b.needs_full = _other_saved_tensor_hooks()
                if not b.needs_full:
                    self._watch = torch.autograd.graph.saved_tensors_hooks(partial(self._saved, b), _same)
                    self._watch.__enter__()

            def post(_mod, _args, out, b=b, prev=prev, last=k == 0):
                if self.backward_phase or not torch.is_grad_enabled():
                    return
                self._stop_watching()
                zero3 = self.zero == 3
                if out is None:  # the forward raised (always_call)
                    return
                if zero3 and not (last and b.needs_full):  # else the backward needs it again at once
                    self._release(b)
                # the bucket before b (in forward order) is gathered as b's backward starts if its
                # own backward reads it, or if it is the first block and another micro-step follows
                early = zero3 and prev is not None and (prev.needs_full or (prev in self.kept and not self.last))

                def reached(grad, b=b, prev=prev):
                    if zero3 and b.needs_full:
                        self._gather(b)
                    if early:
                        self._gather(prev, wait=False)
                    self._open_grad(b)
                    return grad

                if out.requires_grad:
                    out.register_hook(reached)

            if self.zero == 3:
                b.modules[0].register_forward_pre_hook(pre)
            b.modules[-1].register_forward_hook(post, always_call=True)

    def _stop_watching(self):
        if self._watch is not None:
            self._watch.__exit__(None, None, None)
            self._watch = None

    @staticmethod
    def _saved(b, t):
        """Autograd keeps t for bucket b's backward: will the backward read b's gathered buffer?
        (Seen here: what goes through save_for_backward. A custom autograd function that keeps a
        parameter as a plain ctx attribute would escape this check; ours do not.)"""
        if t.device != b.full.device or t.untyped_storage().data_ptr() != b.full.untyped_storage().data_ptr():
            return t
        if b.small.get(t.storage_offset()) == t.numel() and t.dim() == 1:
            return t.clone()  # a LayerNorm weight, a bias: a copy, so the bucket can go
        b.needs_full = True
        return t

    @contextmanager
    def gathered(self):
        """Every parameter present in full (ZeRO-3): for evaluation, sampling, hashing, export."""
        if self.zero != 3:
            yield
            return
        for b in self.buckets:
            self._gather(b)
        self.keep_gathered = True
        try:
            yield
        finally:
            self.keep_gathered = False
            for b in self.buckets:
                self._release(b)

    # -- gradient norm and the parameter all-gather --------------------------------------------
    def _norm_view(self, b, g):
        """The gradient as the norm sees it: tp-replicated parameters only on tp rank 0."""
        if self.tp_rank == 0 or not self.replicated:
            return g
        g = g.clone()
        for a, e in self.segments(b, lambda n, _p: n in self.replicated):
            g[a:e] = 0
        return g

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the reduced gradient, each parameter counted once: a 0-dim tensor on
        the device (reading it is the caller's host synchronisation)."""
        owned = [(b, self._norm_view(b, g)) for b, _, g in self.owned()]
        if not self.exact:
            sq = torch.zeros((), dtype=torch.float32, device=self.device)
            for _, g in owned:
                sq += g.float().pow(2).sum()
            if self.zero >= 1 and self.n > 1:
                self.comm.all_reduce(sq, self.group, "replica").wait()
            if self.tp > 1:
                self.comm.all_reduce(sq, self.tp_group, "tp").wait()
            return sq.sqrt()
        # exact: float64 sums of Q-element chunks by pairwise trees; chunks gathered in canonical
        # order; per bucket a pairwise tree over its chunks; buckets added in order; tp ranks too.
        local = torch.cat([pairwise_sum(g.double().pow(2).view(-1, Q).T) for _, g in owned])
        gathered = self.comm.gather_rows(local, self.group, "replica") if self.zero >= 1 else local[None]
        total, col = torch.zeros(1, dtype=torch.float64, device=self.device), 0
        for b in self.buckets:
            k = (b.shard_size if self.zero >= 1 else b.padded) // Q
            total += pairwise_sum(gathered[:, col : col + k].reshape(-1))
            col += k
        if self.tp > 1:
            total = pairwise_sum(self.comm.gather_rows(total, self.tp_group, "tp"))  # tp-rank order
        return total[0].sqrt()

    def gather_params(self):
        """ZeRO-1/2: every rank updated its shard; the all-gathers (in place) bring them together.
        ZeRO-3 gathers lazily, bucket by bucket, in the next forward pass."""
        if self.zero in (0, 3) or self.n == 1:
            return
        handles = [self.comm.all_gather(b.data, b.data[b.lo : b.hi], self.group, "replica") for b in self.buckets]
        for h in handles:
            h.wait()

    def model_state_bytes(self) -> int:
        """Bytes of parameters and gradients held in this rank's flat buffers (now)."""
        n = 0
        for b in self.buckets:
            n += b.data.numel() + (b.full.untyped_storage().nbytes() // 4 if self.zero == 3 else 0)
            n += b.grad.numel() if self.zero <= 1 else b.shard_grad.numel()
        return 4 * n


def _same(t):
    return t


def _other_saved_tensor_hooks() -> bool:
    """Are saved-tensor hooks of other code active? (A private torch query; if it fails, say yes:
    gathering again is always correct.)"""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
    except (AttributeError, TypeError, RuntimeError):
        return True


class _Then:
    """A handle whose wait() also runs a follow-up step."""

    def __init__(self, inner, fn):
        self.inner, self.fn = inner, fn

    def wait(self):
        self.inner.wait()
        self.fn()
