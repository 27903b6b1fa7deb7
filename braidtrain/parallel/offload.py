"""--offload optimizer: the optimizer's state in host memory, the update on the host.

What lives where. The device keeps what the forward and backward read and write: the compute
weights (the flat buckets, buckets.py) and the gradient buffers. Host memory keeps what only the
optimizer reads: an fp32 master of the shards this rank owns (its ZeRO shard of each bucket; every
bucket at ZeRO-0) and AdamW's m and v for them (optim.AdamW, `offload`). On a GPU the master and
the gradients' staging are pinned, so that the copies are DMA transfers that overlap with host work;
on the CPU the "host" copies are separate tensors and every step below runs as it would, the copies
then done at once.

One step, after the gradients are reduced and the global norm known (engine.finish_step,
engine.grad_norm -- on the device, from the reduced buckets):

    copy stream:  grad k -> slot          (S slots, bounded: never a second full gradient on the host)
    host:         wait for slot k; AdamW on master k, m k, v k (clip scale and skip flag from the device)
    copy stream:  master k -> weights k   (the device's compute weights of the shard)
    copy stream:  grad k+S -> the freed slot

in the order the next forward needs the buckets (the first stage's embedding group, its first block,
...: the reverse of the engine's launch order), so the host's update of one bucket overlaps with the
copies of the others. The compute stream then waits for the last copy; ZeRO-1/2's all-gather and
the next step follow as without offload.

Why the norm first. Clipping scales every element by a factor that needs the norm of the whole
gradient, and the norm is complete only after the last bucket's reduction -- the embedding group's,
at the very end of the backward. Staging every gradient on the host while the backward runs (and
updating once the norm is known) would need a full fp32 gradient in host memory: 4 bytes a
parameter on top of the 12 of master, m and v (llama3.1-8b: 32 GB on top of 96 GB, more than the
GPU machine's 128 GB). So the device computes the norm from the reduced buckets, as it does without
offload (a small fraction of the step), the host waits only for that scalar, and the bounded
staging streams the gradients down bucket by bucket behind it. Never a stale update: the step
updates with its own gradient, and the next step's forward reads the weights this step wrote.

Exactness. The host update is optim.AdamW.apply on host tensors: torch's fused AdamW on the CPU in
default mode; in exact mode optim.exact_adamw, single IEEE operations with the same inputs (the
clip scale and skip flag copied bit for bit from the device), so the same bits as the device's
exact update.
"""

from __future__ import annotations

import time

import torch

SLOTS = 4  # gradient staging slots (each the largest owned shard): copies in flight beside the update


class Offload:
    def __init__(self, engine, opt, slots: int = SLOTS):
        self.e, self.opt = engine, opt
        self.cuda = engine.device.type == "cuda"
        owned = list(engine.owned())
        self.order = list(range(len(owned)))[::-1]  # the next forward's order (module docstring)
        self.master = [torch.empty(p.numel(), pin_memory=self.cuda) for _, p, _ in owned]
        width = max(p.numel() for _, p, _ in owned)
        self.slots = [torch.empty(width, pin_memory=self.cuda) for _ in range(min(slots, len(owned)))]
        self.small = torch.empty(2, pin_memory=self.cuda)  # the clip scale and the skip flag
        self.stream = torch.cuda.Stream(engine.device) if self.cuda else None
        self.seconds = 0.0  # the last step's host update, from the norm's arrival to the last copy's issue
        self.refresh()
        for master, b in zip(self.master, [b for b, _, _ in owned]):  # the master lives here now, once
            b.master, b.apart = master, True

    def refresh(self) -> None:
        """The master from the engine's fp32 master (never from bf16 compute weights): at the start;
        after a checkpoint wrote it (then it is this very tensor: nothing to copy)."""
        for master, (_, p, _) in zip(self.master, self.e.owned()):
            if p is not master:
                master.copy_(p.detach())

    def host_bytes(self) -> int:
        """Bytes of host memory this rank's offloaded state holds (master, m, v, staging)."""
        n = sum(t.numel() for t in self.master + self.slots) + 2 * self.opt.state_numel()
        return 4 * n

    def _copy(self, dst, src):
        """dst <- src on the copy stream (at once on the CPU); the event that says it is done."""
        if self.stream is None:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return done

    @torch.no_grad()
    def step(self, grad_scale, skip) -> None:
        """This step's update of every owned shard, on the host (module docstring)."""
        owned = list(self.e.owned())
        if self.stream is not None:  # the reductions, the norm and the clip scale come first
            self.stream.wait_stream(torch.cuda.current_stream())
        none = torch.zeros((), device=self.e.device)
        ready = self._copy(self.small, torch.stack([none if t is None else t for t in (grad_scale, skip)]))
        copied, n, s = {}, len(self.order), len(self.slots)
        for i in range(min(s, n)):
            k = self.order[i]
            copied[k] = self._copy(self.slots[i][: owned[k][2].numel()], owned[k][2])
        if ready is not None:
            ready.synchronize()
        t0 = time.time()
        scale, flag = (None if t is None else self.small[i] for i, t in enumerate((grad_scale, skip)))
        for i, k in enumerate(self.order):
            if copied[k] is not None:
                copied[k].synchronize()
            b, _, g = owned[k]
            grad = self.slots[i % s][: g.numel()]
            self.opt.apply([self.master[k]], [grad], [self.opt.groups[k]], scale, flag)
            self._copy(b.compute_shard(), self.master[k])  # (bf16 compute weights: rounded on the way)
            if i + s < n:  # the slot is free again: the next bucket's gradient comes down into it
                nxt = self.order[i + s]
                copied[nxt] = self._copy(self.slots[i % s][: owned[nxt][2].numel()], owned[nxt][2])
        if self.stream is not None:  # the next work on the device reads the new weights
            torch.cuda.current_stream().wait_stream(self.stream)
        self.seconds = time.time() - t0
