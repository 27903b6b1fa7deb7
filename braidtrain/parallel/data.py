"""Data parallelism and ZeRO over flat buffers: the one place where gradients are reduced.

Layout. A model stage's parameters become views into flat fp32 buffers, one per *bucket*: runs of
consecutive parameters (in the canonical order of named_parameters, which does not depend on the
world size) of about `bucket_mb` each. Each bucket is padded with zeros to a multiple of n * Q
(n = replica-group size, Q = 64 elements), so it splits into n equal, 256-byte aligned shards:

      bucket k (padded):  [ shard 0 | shard 1 | ... | shard n-1 ]
                            rank 0    rank 1          rank n-1     (ZeRO-1: optimizer state for
                                                                    its own shard only)

Reduction. Each parameter's post-accumulate-grad hook counts down its bucket; on the final
micro-step, the moment a bucket's last gradient is in, its reduction is launched asynchronously
(all-reduce for ZeRO-0, reduce-scatter for ZeRO-1) while the backward pass goes on with earlier
layers. Earlier micro-steps communicate nothing. Gradients are *summed*: the loss was already
divided by the global token count, once.

Exact mode (DESIGN.md, "Exact reduction"). Each micro-step's gradient lands in a fresh buffer and
is folded into a binary counter (slot k holds the sum of 2^k micro-batches), so a rank's m = 2^j
micro-batches are summed along a complete binary tree; the all-to-all + pairwise-sum reduce-
scatter (comm.exact_reduce_scatter) then adds the dp subtrees along the same tree. Any power-of-
two dp gives the one tree over all micro-batches, hence the same bits. The gradient norm is
summed in float64 over fixed 64-element chunks with pairwise trees, so it does not depend on where
shard boundaries fall either.
"""

from __future__ import annotations

import math
import time

import torch

from braidtrain.comm import Comm, pairwise_sum

Q = 64  # shard quantum (elements): alignment, and the chunk of the exact gradient norm


class Bucket:
    def __init__(self, index, params, n_shards, rank, device):
        self.index = index
        self.params = params  # [(name, param)]
        self.numel = sum(p.numel() for _, p in params)
        self.padded = math.ceil(self.numel / (n_shards * Q)) * n_shards * Q
        self.shard_size = self.padded // n_shards
        self.lo = rank * self.shard_size
        self.hi = self.lo + self.shard_size
        self.data = torch.zeros(self.padded, dtype=torch.float32, device=device)
        self.grad = torch.zeros(self.padded, dtype=torch.float32, device=device)
        self.offsets = []
        off = 0
        for _, p in params:
            self.offsets.append(off)
            off += p.numel()
        self.pending = 0
        self.handle = None
        self.slots: dict[int, torch.Tensor] = {}  # exact mode: level -> partial sum of 2^level micro-batches

    def views(self, buf):
        for (_, p), off in zip(self.params, self.offsets):
            yield p, buf[off : off + p.numel()].view_as(p)


class DataParallel:
    def __init__(self, model, mesh, comm: Comm, *, zero: int, exact: bool, bucket_mb: float, device):
        self.model, self.comm, self.zero, self.exact = model, comm, zero, exact
        self.group = mesh.groups["replica"]
        self.n = mesh.size("replica")
        self.rank = mesh.ranks["replica"].index(mesh.rank)
        self.device = device
        named = list(model.named_parameters())  # tied weights appear once
        limit = max(1, int(bucket_mb * 2**20 / 4))
        groups, cur, size = [], [], 0
        # Buckets are filled from the *last* parameter backwards: the backward pass produces the
        # last layers' gradients first, so the first bucket to complete is the first one launched.
        for name, p in reversed(named):
            cur.append((name, p))
            size += p.numel()
            if size >= limit:
                groups.append(cur[::-1])
                cur, size = [], 0
        if cur:
            groups.append(cur[::-1])
        self.buckets = [Bucket(i, g, self.n, self.rank, device) for i, g in enumerate(groups)]
        self.bucket_of = {}
        for b in self.buckets:
            for p, view in b.views(b.data):
                view.copy_(p.detach())
                p.data = view  # the parameter now lives in the flat buffer
                self.bucket_of[p] = b
                p.register_post_accumulate_grad_hook(self._grad_ready)
        # ZeRO-1 keeps only this rank's shard of the reduced gradient
        self.shard_grad = [torch.zeros(b.shard_size, device=device) for b in self.buckets] if zero >= 1 else None
        self.scratch = [torch.empty(b.padded, device=device) for b in self.buckets] if exact and self.n > 1 else None
        self._pool: dict[int, list[torch.Tensor]] = {}
        self.last_grad_time = 0.0
        self.backward_end = 0.0

    # -- what the optimizer sees ---------------------------------------------------------------
    def owned(self):
        """(bucket, param shard, grad shard) triples this rank updates: the whole bucket for ZeRO-0,
        its own shard for ZeRO-1."""
        for i, b in enumerate(self.buckets):
            if self.zero == 0:
                yield b, b.data, b.grad
            else:
                yield b, b.data[b.lo : b.hi], self.shard_grad[i]

    def decay_mask(self, b) -> torch.Tensor:
        """1.0 where weight decay applies (2-D weights), 0.0 elsewhere, over what this rank owns."""
        m = torch.zeros(b.padded, device=self.device)
        for (_, p), off in zip(b.params, b.offsets):
            if p.dim() >= 2:
                m[off : off + p.numel()] = 1.0
        return m if self.zero == 0 else m[b.lo : b.hi].clone()

    # -- a step ---------------------------------------------------------------------------------
    def start_micro_step(self, micro: int, n_micro: int):
        self.last = micro == n_micro - 1
        for b in self.buckets:
            b.pending = len(b.params)
            if self.exact or micro == 0:
                if self.exact:  # a fresh buffer per micro-batch: each is a leaf of the tree
                    if micro == 0:  # last step's reduced gradient goes back to the pool
                        self._pool.setdefault(b.padded, []).append(b.grad)
                    b.grad = self._take(b.padded)
                b.grad.zero_()
                for p, view in b.views(b.grad):
                    p.grad = view  # autograd accumulates into the flat buffer in place

    def _take(self, n):
        pool = self._pool.setdefault(n, [])
        return pool.pop() if pool else torch.empty(n, device=self.device)

    def _grad_ready(self, p):
        b = self.bucket_of[p]
        b.pending -= 1
        if b.pending:
            return
        self.last_grad_time = time.time()
        if self.exact:
            self._fold(b)
        if self.last:
            self._launch(b)

    def _fold(self, b):
        """Binary-counter accumulation: carry the new leaf up while its level is occupied."""
        carry, level = b.grad, 0
        while level in b.slots:
            left = b.slots.pop(level)
            left.add_(carry)  # IEEE addition is commutative: only the tree's shape matters
            self._pool[carry.numel()].append(carry)
            carry, level = left, level + 1
        b.slots[level] = carry
        if self.last:
            assert len(b.slots) == 1 or self.n == 1, "micro-steps per rank must be a power of two"
            # dp == 1 with any micro-step count: fold the remaining levels, smallest first
            while len(b.slots) > 1:
                lo = min(b.slots)
                part = b.slots.pop(lo)
                nxt = min(b.slots)
                b.slots[nxt].add_(part)
                self._pool[part.numel()].append(part)
            b.grad = b.slots.pop(max(b.slots))

    def _launch(self, b):
        i = b.index
        if self.exact:
            out = b.grad if self.zero == 0 else self.shard_grad[i]
            dst = out[b.lo : b.hi] if self.zero == 0 else out
            scratch = self.scratch[i] if self.scratch is not None else None
            h = self.comm.exact_reduce_scatter(dst, b.grad, scratch, self.group, "replica", self.n)
            if self.zero == 0 and self.n > 1:  # rebuild the full gradient from the reduced shards
                inner = h

                def gather(b=b, inner=inner):
                    inner.wait()
                    self.comm.all_gather(b.grad, b.grad[b.lo : b.hi].clone(), self.group, "replica").wait()

                h = _Deferred(gather)
            b.handle = h
        elif self.zero == 0:
            b.handle = self.comm.all_reduce(b.grad, self.group, "replica")
        else:
            b.handle = self.comm.reduce_scatter(self.shard_grad[i], b.grad, self.group, "replica")

    def finish_reduction(self) -> float:
        """Wait for every bucket's reduction; returns the exposed communication time (seconds
        the step waited after the backward pass ended)."""
        self.backward_end = time.time()
        for b in self.buckets:
            b.handle.wait()
            b.handle = None
        return time.time() - self.backward_end

    # -- gradient norm and the parameter all-gather --------------------------------------------
    def grad_norm(self) -> float:
        """Global L2 norm of the reduced gradient, each parameter counted once."""
        if not self.exact:
            sq = torch.zeros((), dtype=torch.float32, device=self.device)
            for _, _, g in self.owned():
                sq += g.float().pow(2).sum()
            if self.zero >= 1 and self.n > 1:
                self.comm.all_reduce(sq, self.group, "replica").wait()
            return math.sqrt(sq.item())
        # exact: float64 sums of Q-element chunks by pairwise trees; chunks gathered in canonical
        # order; per bucket a pairwise tree over its chunks; buckets added in order.
        local = torch.cat([pairwise_sum(g.double().pow(2).view(-1, Q).T) for _, _, g in self.owned()])
        if self.zero >= 1:
            gathered = self.comm.all_gather_object_floats(local, self.group, "replica")  # (n, chunks)
        else:
            gathered = local.unsqueeze(0)
        total, col = torch.zeros((), dtype=torch.float64, device=self.device), 0
        for b in self.buckets:
            k = b.shard_size // Q if self.zero >= 1 else b.padded // Q
            total += pairwise_sum(gathered[:, col : col + k].reshape(-1))
            col += k
        return math.sqrt(total.item())

    def scale_grads(self, factor: float):
        for _, _, g in self.owned():
            g.mul_(factor)

    def gather_params(self):
        """ZeRO-1: every rank updated its shard; one all-gather per bucket brings them together."""
        if self.zero == 0 or self.n == 1:
            return
        handles = [self.comm.all_gather(b.data, b.data[b.lo : b.hi].clone(), self.group, "replica") for b in self.buckets]
        for h in handles:
            h.wait()

    def model_state_bytes(self) -> int:
        """Bytes of parameters and gradients held in this rank's flat buffers."""
        n = sum(b.data.numel() + b.grad.numel() for b in self.buckets)
        if self.shard_grad is not None:
            n += sum(g.numel() for g in self.shard_grad)
        return 4 * n


class _Deferred:
    def __init__(self, fn):
        self.fn = fn

    def wait(self):
        self.fn()
