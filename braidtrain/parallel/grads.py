"""The gradient buffers' lifetime: which fp32 gradient buffer of a bucket exists when, and the pool
that hands out and takes back the bucket-sized ones (the Engine holds one Grads: `engine.grads`).

What lives when:
  - ZeRO-0/1, default mode: the step's first gradient of a bucket opens its buffer, afresh (first(),
    a tensor hook), and the step's micro-batches accumulate in it in place; it lives from the
    backward that reaches the bucket to the update (drop(), at gather_params) -- not through the
    forward: as the backward frees activations it fills gradients.
  - ZeRO-2/3: no full gradient buffer. A bucket-sized scratch from the pool is opened as each
    backward reaches the bucket (zero.py), the parameters' .grad views into it so that autograd
    adds each gradient into it in place, and it goes to the reduce-scatter when complete and is freed
    once the collective has read it (on CUDA: record_stream on the collective's stream; only exact
    mode's tree gives buffers back to the pool); the result is added into the persistent shard (b.shard_grad).
  - Exact mode: each backward's gradient is a fresh buffer from the pool, a leaf of exact.py's
    tree -- or, an odd micro-batch whose even sibling's leaf is complete, that leaf, which the
    backward adds into (`sibling`: the tree's first level folded into the backward, exact.py); the
    tree gives leaves back (recycle) as it adds them, and the step's root lives to the update and
    goes back at the next step's start (Engine.begin_step).
  - A lean bucket (bf16 compute weights): autograd's bf16 gradient arrives in .grad and the
    engine's post-accumulate hook adds it into `main_grad`, the view into the fp32 buffer (or
    writes it: below).
  - --offload optimizer: the host's update holds its own references to the step's gradients until
    each has come down (offload.py); drop() lets the engine's go at once.

Written, not added. In default mode a fresh buffer's first gradients are written into it (copy_), not
added to zeros: ZeRO-0/1's step buffer (its first backward of the step: an fp32 parameter's .grad is
then left to autograd, which hands over its own gradient tensor, and the hook copies it in and points
.grad at the view, so the later micro-steps add in place) and a lean bucket's ZeRO-2/3 scratch (the
hook copies instead of adding). Nothing zeroes the buffer but the positions no parameter holds (the
gaps between parameters and slices, the padding: at opening); a parameter whose view no gradient
wrote (none arrived in that backward) is zeroed when the bucket's backward completes (written()).
The same sum as zeroing and adding: 0 + x is x, bit for bit, but for x = -0 (a -0 gradient element
stays -0 where it became +0: at most the sign of a zero differs downstream, never a value). At 1B it spares the
buffer's 5 GB zero fill and the add's read of it. Not written: ZeRO-2/3's fp32 buckets (autograd
adds into the scratch in place: a copy in the hook cost host time a parameter, docs/design-notes.md)
and exact mode, whose leaves and folds stay zeroed and added (exact.py); which gradient is written
is decided by the Python side alone (the step's first backward of a bucket, and which parameters'
hooks ran in it), the same at every replay of a captured --cuda-graph step.
"""

from __future__ import annotations

import torch


class Grads:
    """The buckets' gradient buffers and the pool of bucket-sized ones (module docstring)."""

    def __init__(self, buckets, device, exact: bool = False):
        self.buckets, self.device, self.exact = buckets, device, exact
        self.pool: dict[int, list[torch.Tensor]] = {}
        self.sibling = lambda b: None  # exact mode: the leaf a backward adds into, if any (Engine.sibling)
        self.gaps: dict = {}  # bucket -> [(lo, hi)]: the positions no parameter holds (gaps_of())

    def open(self, b, buf=None) -> None:
        """Open bucket b's gradient buffer `buf` (None: the complete sibling leaf `sibling(b)` gives,
        or else a fresh one from the pool) and point its parameters' .grad (a lean bucket's
        `main_grad`) at views into it. Written (module docstring): only the gaps are zeroed, and
        each parameter's first gradient is written by the engine's hook (arrived()). Otherwise
        zeroed, and autograd adds each gradient into it in place. (Copying each gradient out in a
        hook instead cost host time a parameter; at ZeRO-2/3 the GPU zeroes and adds fp32 buckets:
        more bytes, less host time. docs/design-notes.md.)"""
        into = self.sibling(b) if buf is None else None
        write = into is None and not self.exact and (b.lean or b.zero <= 1)
        b.grad = into if into is not None else (buf if buf is not None else self.take(b.padded))
        b.unwritten = {} if write else None
        if write:
            for lo, hi in self.gaps_of(b):
                b.grad[lo:hi].zero_()
        elif into is None:
            b.grad.zero_()
        for p, view in b.views(b.grad):
            if write:
                b.unwritten[p] = view
            if b.lean:  # a bf16 parameter: the engine's hook adds (writes) autograd's gradient here
                p.main_grad = view
            else:  # (written: autograd keeps its own gradient until the hook copies it in)
                p.grad = None if write else view
        b.open = True

    def arrived(self, b, p) -> None:
        """Parameter p's gradient of this backward is in .grad (the engine's post-accumulate hook):
        written into its view if none was yet (module docstring) -- an fp32 parameter's .grad then
        the view, in which autograd adds the later micro-steps' -- else a lean bucket's added into
        `main_grad`. No gradient (.grad None): nothing."""
        view = b.unwritten.pop(p, None) if b.unwritten is not None else None
        if p.grad is None:
            if view is not None:  # still to be written, or zeroed (written())
                b.unwritten[p] = view
            return
        if view is None:
            if b.lean:  # autograd's bf16 gradient, made fp32 and added, as autocast's cast's backward did
                p.main_grad.add_(p.grad)
            return
        view.copy_(p.grad)  # (a bf16 gradient made fp32: exact)
        if not b.lean:
            p.grad = view

    def written(self, b) -> None:
        """Bucket b's backward is complete: each view that no gradient wrote is zeroed (a parameter
        that got none), and later backwards add."""
        if b.unwritten is None:
            return
        for p, view in b.unwritten.items():
            view.zero_()
            if not b.lean and b.zero <= 1:
                p.grad = view
        b.unwritten = None

    def gaps_of(self, b) -> list[tuple[int, int]]:
        """The ranges [lo, hi) of bucket b's buffer that no parameter holds (between parameters and
        expert slices: Q alignment; the padding), merged."""
        if b not in self.gaps:
            held = sorted((pos, pos + n) for i in range(len(b.params)) for _, pos, n in b.runs(i))
            out, at = [], 0
            for lo, hi in held + [(b.padded, b.padded)]:
                if lo > at:
                    out.append((at, lo))
                at = max(at, hi)
            self.gaps[b] = out
        return self.gaps[b]

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
                b.grad, b.unwritten = None, None
                for _, p in b.params:
                    p.grad = None
                    if b.lean:
                        p.main_grad = None

    def reset(self) -> None:
        """An empty pool: the buffers were laid out again, or others may still write into the old ones."""
        self.pool, self.gaps = {}, {}
