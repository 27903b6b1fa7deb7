"""The gradient buffers' lifetime: which fp32 gradient buffer of a bucket exists when, and the pool
that hands out and takes back the bucket-sized ones (the Engine holds one Grads: `engine.grads`).

What lives when:
  - ZeRO-0/1, default mode: the step's first gradient of a bucket opens its buffer, afresh (first(),
    a tensor hook), and the step's micro-batches accumulate in it in place; it lives from the
    backward that reaches the bucket to the update (drop(), at gather_params) -- not through the
    forward: as the backward frees activations it fills gradients.
  - ZeRO-2/3: no full gradient buffer. A bucket-sized scratch from the pool is opened as each
    backward reaches the bucket (zero.py), the parameters' .grad views into it so that autograd
    adds into it in place, and it goes to the reduce-scatter when complete and is freed once the
    collective has read it (on CUDA: record_stream on the collective's stream; only exact mode's
    tree gives buffers back to the pool); the result is added into the persistent shard (b.shard_grad).
  - Exact mode: each backward's gradient is a fresh buffer from the pool, a leaf of exact.py's
    tree -- or, an odd micro-batch whose even sibling's leaf is complete, that leaf, which the
    backward adds into (`sibling`: the tree's first level folded into the backward, exact.py); the
    tree gives leaves back (recycle) as it adds them, and the step's root lives to the update and
    goes back at the next step's start (Engine.begin_step).
  - A lean bucket (bf16 compute weights): autograd's bf16 gradient arrives in .grad and the
    engine's post-accumulate hook adds it into `main_grad`, the view into the fp32 buffer.
  - --offload optimizer: the host's update holds its own references to the step's gradients until
    each has come down (offload.py); drop() lets the engine's go at once.
"""

from __future__ import annotations

import torch


class Grads:
    """The buckets' gradient buffers and the pool of bucket-sized ones (module docstring)."""

    def __init__(self, buckets, device):
        self.buckets, self.device = buckets, device
        self.pool: dict[int, list[torch.Tensor]] = {}
        self.sibling = lambda b: None  # exact mode: the leaf a backward adds into, if any (Engine.sibling)

    def open(self, b, buf=None) -> None:
        """Zero the bucket's gradient buffer `buf` (None: the complete sibling leaf `sibling(b)`
        gives, not zeroed, or else a fresh one from the pool) and point its parameters' .grad at
        views into it: autograd then adds each gradient into it in place. (Copying each gradient
        out in a hook instead cost host time a parameter; the GPU now zeroes and adds: more bytes,
        less host time. docs/design-notes.md.)"""
        into = self.sibling(b) if buf is None else None
        b.grad = into if into is not None else (buf if buf is not None else self.take(b.padded)).zero_()
        for p, view in b.views(b.grad):
            if b.lean:  # a bf16 parameter: the engine's hook adds autograd's gradient here (module docstring)
                p.main_grad = view
            else:
                p.grad = view
        b.open = True

    def take(self, n: int) -> torch.Tensor:
        """A gradient-sized buffer of n fp32 elements from the pool (contents undefined)."""
        pool = self.pool.setdefault(n, [])
        return pool.pop() if pool else torch.empty(n, device=self.device)

    def recycle(self, buf: torch.Tensor) -> None:
        """Give a buffer from take() back to the pool, once nothing reads it any more."""
        pool = self.pool.setdefault(buf.numel(), [])
        if all(g is not buf for g in pool):  # (a failed step may have put it there already)
            pool.append(buf)

    def first(self, b, grad):
        """ZeRO-0/1 (default mode), a tensor hook: the step's first gradient of bucket b opens its
        buffer, afresh (module docstring)."""
        if b.first and not b.sourced:
            b.first = False
            self.open(b, torch.empty(b.padded, device=self.device))
        return grad

    def drop(self) -> None:
        """The step's update has read ZeRO-0/1's full gradients: they go (the next step's first
        gradients open them again), so nothing of them lives through the next forward."""
        for b in self.buckets:
            if b.zero <= 1 and b.grad is not None:
                b.grad = None
                for _, p in b.params:
                    p.grad = None
                    if b.lean:
                        p.main_grad = None

    def reset(self) -> None:
        """An empty pool: the buffers were laid out again, or others may still write into the old ones."""
        self.pool = {}
