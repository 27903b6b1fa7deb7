"""--offload optimizer: the optimizer's state in host memory (all of it, or the share R of
--offload-ratio: "Kept buckets" below), its update on the host, overlapped with the next step's
forward -- and still this step's update, never a stale one.

What lives where. The device keeps what the forward and backward read and write: the compute
weights (the flat buckets, buckets.py) and the gradient buffers. Host memory keeps what only the
optimizer reads: an fp32 master of the shards this rank owns (its ZeRO shard of each bucket; every
bucket at ZeRO-0) and AdamW's m and v for them (optim.AdamW). On a GPU the master and the staging
slots are pinned: the copies are DMA transfers, on one side stream, each after the one before.

One step. The main thread hands the update to a worker thread and goes on into the next step; the
worker updates bucket by bucket in the next forward's order (by chunk: the buckets of no block,
then block by block), and each forward waits only for its own bucket's weights:

    main    ..B B | reduce | norm, hand over | loss, log | F embed: wait w0 | F block 0: wait w1 | ..
    copy          |   g0 g1 g2 g3 s          |    w0 g4      w1 g5      w2 g6      w3 g7 ..
    worker        |                   wait s | adam 0 | adam 1 | adam 2 | adam 3 | adam 4 ..
    (g: a gradient down into one of S = 4 slots; s: the clip scale and skip flag; w: weights up)

  - Down, and the clip norm. The reductions are complete at the end of engine.finish_step, and the
    first S gradients start down there (start()), before the norm is known. The norm is computed
    on the device from the reduced buckets, as without offload (a small share of the step), and
    comes down as two numbers. The other design -- every gradient staged on the host during the
    backward, the update held until the norm is known -- needs a full fp32 gradient in host
    memory (llama3.1-8b: 32 GB beside the 96 of master, m and v: more than the GPU machine's 128).
    Staging stays bounded: a slot takes the next gradient as soon as its update has read it.
  - The update. optim.AdamW.apply on the bucket's master, gradient slot, m and v -- in default mode
    with the weight decay inside torch's fused kernel (decay_in_kernel: the decayed ranges in one
    call, the rest in another), not as a pass of its own over the master: on the H200 host that pass
    cost a fifth of the update's time (offload_probe.py --loop), the host's memory bandwidth being
    what the update is bound by.
  - Up. A bucket's master is copied into the device's weights; where they are narrower (bf16), in
    fp32 into a device slot as wide as the widest such shard and rounded there, on the copy
    stream (each copy and rounding after the one before: one slot serves them all). Rounding on the
    host instead was a pass of its own over the master, a sixth of the worker's time on the H200
    host; the copy stream moves twice the bytes up for it, which it has to spare (a 218 M-element
    bucket's gradient came down in ~16 ms against ~60 ms of its update). Then `landed[k]` is set
    (on a GPU after `arrived[k]`, a CUDA event, is recorded).
  - Waiting (ready(b)). A forward pre-hook on each bucket's first block (a bucket of no block: on
    its chunk) waits for that bucket only; on a GPU the compute stream then waits for `arrived[k]`
    (an event the host must know was recorded: hence the host's wait). ZeRO-1/2's all-gather of
    the updated shard is issued there (engine.gather_params leaves it), and ZeRO-3's gather
    (zero.py) asks ready(b) before it reads the shard; a prefetch never waits (whether an update
    has landed differs between ranks; the order of the collectives may not). With a pipeline,
    ZeRO-1/2's gathers all come at the step's start, before any transfer between stages. The
    main thread's waits are the exposed part of the update: the metrics' offload_s (on a GPU an
    upper bound of the device's idle time; it runs the work queued before the wait).
  - wait(): whatever reads the weights or moments between steps waits for the whole update first:
    engine.gathered() (validation, evaluation, sampling, the weights' hash at the run's end),
    checkpoint.save and the trainer's save (its non-finite check) -- and the next step's first
    backward, before a gradient buffer is written (the worker copies down from them: so ZeRO-0/1
    open their buffer there, not at the step's start).

Kept buckets (--offload-ratio R, 0 < R <= 1, default 1). R is the share of this rank's owned
optimizer elements that lives on the host. kept() picks the leading buckets in the next forward's
order -- those whose weights the next forward needs first, which must never wait on the host -- as
many as fit in (1 - R) of the owned elements, stopping at the first that does not (so the hosted
share is at least R; all of it when the first bucket alone is over 1 - R); they keep their fp32
master and AdamW's m and v on the device and are updated there at step(), by the path without
offload (optim.AdamW.update: apply, then engine.publish of those buckets; ZeRO-1/2's all-gather in
engine.gather_params). The rest are hosted as above: the worker, the copies and the waits (ready(),
wait()) are theirs only. The host's memory bandwidth bounds the hosted update, so keeping a share on
the device takes that share's update and copies off the host's time. Checkpoints read and write each
bucket's master, m and v where they are (io/checkpoint.py): a run resumes at another R, or without
offload. A tied embedding split over a pipeline's first and last stages is always hosted, on both
(each stage sizes its own budget; one copy updated on the device, the other on the host, would drift
apart). The planner prices exactly (1 - R) as kept.

Threads. torch.set_num_threads is process-wide: a GPU run sets it to this rank's cores (its
affinity shared among the node's LOCAL_WORLD_SIZE ranks), for the host update -- the main thread
only launches kernels; a CPU run, where device and host share the cores, keeps what it had. On the
CPU the copies are plain copies, at once, and the rest -- the worker, its order, the events, the
waits -- runs as on a GPU.

Exactness. The host update is optim.AdamW.apply on host tensors, with the step's scalars as they
were when it was handed over (the next step's prepare() rewrites them): torch's fused AdamW in
default mode; in exact mode optim.exact_adamw, single IEEE operations with the same inputs (the
clip scale and skip flag copied bit for bit), so the same bits as the device's update -- which is
what a kept bucket gets (exact_kernels on a GPU: the same operations), so R changes no bit.
"""

from __future__ import annotations

import math
import os
import threading
import time

import torch

SLOTS = 4  # gradient staging slots (each the largest owned shard): copies in flight beside the update


def host_threads() -> int:
    """The cores this rank's host update may use: the process's, shared among the node's ranks (all
    of them: one fewer ran the 3B run's update 3% slower on the H200 host, docs/performance.md).
    BRAIDTRAIN_HOST_THREADS overrides it (a measurement's knob: offload_settings.py)."""
    if os.environ.get("BRAIDTRAIN_HOST_THREADS"):
        return max(1, int(os.environ["BRAIDTRAIN_HOST_THREADS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def forward_order(engine, buckets) -> list[int]:
    """The positions of `buckets` in the next forward's order: by chunk, then where each is first
    read (a bucket of no block first), then as the engine numbers them (zero.py gathers those of
    one place so)."""
    block = {m: i for part in engine.parts for i, m in enumerate(part.blocks())}
    where = lambda b: (b.stage, block[b.modules[0]] if b.modules else -1, b.index)
    return sorted(range(len(buckets)), key=lambda k: where(buckets[k]))


def kept(engine, ratio: float) -> list[int]:
    """--offload-ratio R: the owned buckets (positions in engine.owned()) that stay on the device --
    the leading ones in the next forward's order, whose owned elements total at most (1 - R) of this
    rank's (module docstring, "Kept buckets"), and at least one element hosted. The same on every
    rank of a bucket's group: its shards are equal. A tied embedding split over a pipeline's first
    and last stages is hosted on both: each stage sizes its own budget, and one copy updated on the
    device, the other on the host would drift apart (tied.py: the copies stay bitwise equal)."""
    if ratio >= 1:
        return []
    owned = [b for b, _, _ in engine.owned()]
    sizes = [p.numel() for _, p, _ in engine.owned()]
    split = set(engine.tied.buckets) if engine.tied.partner is not None else set()
    budget, got, out = sum(sizes) - max(1, math.ceil(ratio * sum(sizes))), 0, []
    for k in forward_order(engine, owned):
        if owned[k] in split:
            continue
        if got + sizes[k] > budget:
            break
        got += sizes[k]
        out.append(k)
    return sorted(out)


class Offload:
    """`kept`: the owned buckets (kept()) the device updates (optim.AdamW.update); the rest are hosted."""

    def __init__(self, engine, opt, kept=(), slots: int = SLOTS):
        self.e, self.opt = engine, opt
        self.cuda = engine.device.type == "cuda"
        self.kept = sorted(kept)
        self.idx = sorted(set(range(len(list(engine.owned())))) - set(kept))  # hosted k: owned()[idx[k]]
        owned = self._hosted()
        self.buckets = [b for b, _, _ in owned]
        self.at = {b: k for k, b in enumerate(self.buckets)}
        self.order = forward_order(engine, self.buckets)  # (the worker's and the waits')
        self.rank = {k: i for i, k in enumerate(self.order)}
        self.master = [torch.empty(p.numel(), pin_memory=self.cuda) for _, p, _ in owned]
        width = max(p.numel() for _, p, _ in owned)
        self.slots = [torch.empty(width, pin_memory=self.cuda) for _ in range(min(slots, len(owned)))]
        # (GPU) where the device's weights are narrower than the master (bf16): the master goes up in
        # fp32 through this device slot and is rounded there (module docstring, "Up")
        # (the buckets of no block stay fp32, buckets.lean: so as wide as the widest bf16 shard)
        narrow = [p.numel() for b, p, _ in owned if self.cuda and b.compute_shard().dtype != torch.float32]
        self.up_slot = torch.empty(max(narrow), device=engine.device) if narrow else None
        self.small = torch.empty(2, pin_memory=self.cuda)  # the clip scale and the skip flag
        self.stream = torch.cuda.Stream(engine.device) if self.cuda else None  # one: each copy after the one before
        n = len(owned)
        self.landed = [threading.Event() for _ in range(n)]  # bucket k's weights are on their way up
        self.arrived = [None] * n  # (GPU) the event after bucket k's copy up
        self.copied = [None] * n  # (GPU) the event after bucket k's gradient came down
        self.flying = [False] * n  # (main thread) an update of bucket k not waited for yet
        self.params = self.grads = None  # the step's owned shards, taken when the reductions are done
        self.fold = True  # default mode: the decay inside the fused kernel, no pass of its own (module docstring)
        self.thread, self.error, self.started = None, None, False
        self.hold, self.asked, self.cond = False, n, threading.Condition()  # the test hook (_gate)
        self.update_s = self.waited_s = 0.0  # the last update's seconds on the host; the main thread's waits
        # the times the main thread found a bucket not landed yet: in a forward (a gather), in wait()
        self.waits, self.whole = {"forward": 0, "whole": 0}, False
        self.gather_first = engine.pp.size > 1 and any(b.zero in (1, 2) for b in self.buckets)
        for b in (self.buckets[k] for k in self.order):  # the hooks that wait (module docstring), in
            part = next(p for p in engine.parts if p.stage == b.stage)  # order where several share a module
            # (`and None`: a pre-hook that returns something replaces the module's inputs)
            (b.modules[0] if b.modules else part).register_forward_pre_hook(lambda _m, _a, b=b: self.ready(b) and None)
        engine.updates = self
        if self.cuda:
            torch.set_num_threads(host_threads())
        self.refresh()
        for master, b in zip(self.master, self.buckets):  # the master lives here now, once
            b.master, b.apart, b.hosted = master, True, True

    def refresh(self) -> None:
        """The master from the engine's fp32 master (never from bf16 compute weights): at the start;
        after a checkpoint wrote it (then it is this very tensor: nothing to copy)."""
        self.wait()
        if self.stream is not None:  # the last copies up read the master itself (_up): done before it is written
            self.stream.synchronize()
        for master, (_, p, _) in zip(self.master, self._hosted()):
            if p is not master:
                master.copy_(p.detach())

    def _hosted(self) -> list:
        """engine.owned() of the hosted buckets."""
        owned = list(self.e.owned())
        return [owned[i] for i in self.idx]

    def host_bytes(self) -> int:
        """Bytes of host memory this rank's offloaded state holds (master, m, v, staging)."""
        n = sum(t.numel() for t in self.master + self.slots) + 2 * sum(self.opt.groups[i][0].numel() for i in self.idx)
        return 4 * n

    # -- the main thread -----------------------------------------------------------------------
    def start(self) -> None:
        """The step's gradients are reduced (engine.finish_step): the first slots come down now."""
        self.wait()
        owned = self._hosted()
        # the device's compute weights the update writes (bf16 in a lean state), the gradients it reads
        self.params, self.grads = [b.compute_shard() for b, _, _ in owned], [g for _, _, g in owned]
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
        for i in range(len(self.slots)):
            self._down(i)
        self.started = True

    def step(self, grad_scale, skip) -> None:
        """Hand this step's update to the worker (module docstring); returns at once."""
        if not self.started:
            self.start()
        self.started = False
        none = torch.zeros((), device=self.e.device)
        small = torch.stack([none if t is None else t for t in (grad_scale, skip)])
        if self.stream is not None:  # the norm, the clip scale and the skip flag (that stack too) come first,
            self.stream.wait_stream(torch.cuda.current_stream())
            small.record_stream(self.stream)  # and its memory is not reused before the copy has read it
        ready = self._copy(self.small, small)
        scalars = tuple(s.clone() for s in self.opt.scalars["cpu"])  # (prepare() rewrites them for the next step)
        for k in range(len(self.buckets)):
            self.landed[k].clear()
            self.flying[k] = True
        self.asked = -1 if self.hold else len(self.order)
        # (not a daemon: the interpreter joins it before its teardown, which aborts a process whose
        # thread is still inside torch -- "terminate called without an active exception", seen on the H200)
        self.thread = threading.Thread(target=self._work, args=(ready, grad_scale is not None, skip is not None,
                                                                scalars), name="offload")
        self.thread.start()

    def ready(self, b, block: bool = True) -> bool:
        """Bucket b's update has landed (its ZeRO-1/2 all-gather done; on a GPU the compute stream
        waits for its copy up). block=False: say whether it had been waited for, waiting for nothing."""
        k = self.at.get(b)
        if k is None or not self.flying[k]:  # (a kept bucket: updated and gathered at the step's end)
            return True
        if not block:
            return False
        if not self.landed[k].is_set():
            with self.cond:  # (the test hook's: _gate)
                self.asked = max(self.asked, self.rank[k])
                self.cond.notify()
            t0 = time.time()
            self.landed[k].wait()
            self.waited_s += time.time() - t0
            self.waits["whole" if self.whole else "forward"] += 1
        if self.error is not None:
            raise RuntimeError(f"the host's optimizer update failed: {self.error!r}") from self.error
        self.flying[k] = False
        if self.arrived[k] is not None:
            torch.cuda.current_stream().wait_event(self.arrived[k])
        if b.zero in (1, 2):  # every rank updated its shard: the bucket comes together
            self.e.comm.all_gather(b.data, b.data[b.lo : b.hi], b.group).wait()
        return True

    def wait(self) -> None:
        """The whole update has landed: before anything reads the weights or moments between steps."""
        self.whole = True
        for k in self.order:
            self.ready(self.buckets[k])
        self.whole = False
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def begin_step(self) -> None:
        """The step's first forward is next: with a pipeline, ZeRO-1/2's gathers now (module docstring)."""
        if self.gather_first:
            self.wait()

    def figures(self) -> tuple[float, float]:
        """(seconds the main thread waited for host updates since the last call, the seconds of the
        last update that landed, on the host) -- a step's offload_s and offload_update_s."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited, self.update_s

    # -- the worker --------------------------------------------------------------------------------
    @torch.no_grad()
    def _work(self, ready, scaled: bool, skipped: bool, scalars) -> None:
        try:
            if self.cuda:
                torch.cuda.set_device(self.e.device)
                torch.set_num_threads(host_threads())  # (OpenMP's team size is each thread's own setting)
            if ready is not None:
                ready.synchronize()
            t0 = time.time()
            scale, flag = self.small[0] if scaled else None, self.small[1] if skipped else None
            n, s = len(self.order), len(self.slots)
            for i, k in enumerate(self.order):
                self._gate(i)
                if self.copied[k] is not None:  # (and so every copy before it, the last step's up too)
                    self.copied[k].synchronize()
                grad = self.slots[i % s][: self.grads[k].numel()]
                self.grads[k] = None  # on the host now: the device's copy may go (grads.py)
                self.opt.apply([self.master[k]], [grad], [self.opt.groups[self.idx[k]]], scale, flag, scalars,
                               decay_in_kernel=self.fold)
                self.arrived[k] = self._up(k)
                if i + 1 == n:
                    self.update_s = time.time() - t0
                self.landed[k].set()
                if i + s < n:  # the slot is free again: the next bucket's gradient comes down into it
                    self._down(i + s)
        except BaseException as e:  # (the main thread raises it at its next wait)
            self.error = e
        finally:
            for ev in self.landed:
                ev.set()

    def _gate(self, i: int) -> None:
        """The test hook (`hold`, BRAIDTRAIN_FAULT hold-offload): the worker updates the i-th bucket
        only once the main thread has asked for it or a later one -- so that whatever reads weights
        without waiting finds them stale, every time."""
        if self.hold:
            with self.cond:
                self.cond.wait_for(lambda: self.asked >= i)

    def _up(self, k: int):
        """Bucket k's master into the device's weights (module docstring, "Up"); the event after it."""
        p, master = self.params[k], self.master[k]
        if self.up_slot is None or p.dtype == master.dtype:
            return self._copy(p, master)  # (on the CPU the copy converts)
        with torch.cuda.stream(self.stream):  # each after the one before: the slot is free again
            slot = self.up_slot[: master.numel()]
            slot.copy_(master, non_blocking=True)
            p.copy_(slot)  # rounded to nearest even, as publish() rounds without offload
            done = torch.cuda.Event()
            done.record()
        return done

    def _down(self, i: int) -> None:
        """The gradient of the i-th bucket in order into slot i % S."""
        k = self.order[i]
        self.copied[k] = self._copy(self.slots[i % len(self.slots)][: self.grads[k].numel()], self.grads[k])

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
