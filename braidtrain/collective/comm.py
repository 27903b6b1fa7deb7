"""Every collective and point-to-point operation of the project goes through here.

A collective runs over a `Group`: a mesh axis (tp, replica, world, ...), its member ranks and
torch's process group. Each call is recorded (this rank's sequence number, the group's name and
the group's own sequence number, operation, shape, dtype, bytes, step, launch and end time) in a
ring buffer -- the flight log a hung or crashed rank leaves behind (fault.py writes it, `braidtrain
doctor` reads it) -- and summed per step into `comm_s`. The members of a group issue its
collectives in the same order, so the group's sequence number k names the same collective on
each of them, however many collectives other groups ran meanwhile; that is what lets doctor line
the ranks' logs up, group by group. The exact reduce-scatter (docs/architecture.md, "Exact reduction")
lives here too.

Streams: on CUDA, torch's NCCL process group already runs every collective on its own internal
stream, made to wait (by an event) for the work queued before it on the compute stream; and
`work.wait()` makes the compute stream wait, by an event, for the collective -- no host or device-wide
synchronisation. We add a pair of timing events around each collective on a side stream of ours so
that its duration can be read at the end of the step without stalling the step itself.

Inside a CUDA graph capture (--cuda-graph) the collectives are captured with the rest of the step
and launched again by every replay, not by Python: their timing events are graph nodes
(`external`), so each replay times its own collectives, and `replayed()` writes one flight record
per replayed step in place of the collectives' own.

The collectives of tensor parallelism (model/layers.py) sit on the critical path: the layer waits
for each at once. They run `inline`: on the stream that issues them, with no side-stream hop.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from collections import deque
from contextlib import contextmanager

import torch
import torch.distributed as dist

from braidtrain.collective.flight import Handle, Record, AllWorks, timing_events
from braidtrain.collective.group import Group

# torch 2.13 renamed the *_tensor collectives to *_single; 2.11 has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus factor (its PERFORMANCE.md): busbw = (message bytes / time) x this, which
    makes the operations comparable with the link speed. Nothing crosses a link when n = 1."""
    if n == 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "send_recv": 1.0}.get(op, (n - 1) / n)


class Comm:
    def __init__(self, device: torch.device, capacity: int = 2048):
        self.device = device
        self.cuda = device.type == "cuda"
        self.records: deque[Record] = deque(maxlen=capacity)
        self.seq = 0
        self.gseq: dict[str, int] = {}  # group name -> operations recorded on it
        self.members: dict[str, list[int]] = {}  # group name -> its ranks, for the flight log's header
        self.step = 0  # stamped on each record (begin_step)
        self.step_handles: list[Handle] = []
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.ready = torch.cuda.Event() if self.cuda else None  # recorded on the compute stream, waited for by side
        self.spare: list[tuple] = []  # timing event pairs already read, to record again
        self.replay_rec: Record | None = None  # the open flight record of a replayed graph
        self.abort: threading.Event | None = None  # live recovery (live/): set, waits give up (Aborted)

    # -- the step ------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """The training step (1-based) that the next records belong to."""
        self.step = step

    @contextmanager
    def capture(self):
        """Around a CUDA graph capture: yields the list that receives the handles of the
        collectives launched inside (for replayed()); they are not this step's."""
        before, captured = len(self.step_handles), []
        try:
            yield captured
        finally:
            captured += self.step_handles[before:]
            del self.step_handles[before:]

    # -- bookkeeping ---------------------------------------------------------------------------
    def _launch(self, op, group: Group, tensor, fn, then=None, inline=False, what="", direct=False) -> Handle:
        rec = self._record(op, group, tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""),
                           tensor.numel() * tensor.element_size(), what)
        if group.pg is None:  # a one-rank group: nothing to exchange
            h = Handle(self, rec, None, then)
        elif self.cuda and inline:
            # On the critical path (tp): issued on this stream, which waits for it at once.
            capturing = torch.cuda.is_current_stream_capturing()
            start, end = timing_events() if capturing or not self.spare else self.spare.pop()
            stream = torch.cuda.current_stream()
            start.record(stream)
            fn(group.pg).wait()
            end.record(stream)
            h = Handle(self, rec, None, then, events=(start, end))
            h.reuse = not capturing
        elif self.cuda and not direct:
            # Launch from our side stream: it first waits (an event) for what the compute stream has
            # queued -- the gradients this collective reads -- and the compute stream goes on with the
            # rest of the backward pass; Handle.wait() makes the compute stream wait for `join`.
            # ZeRO-3 comes here ~100 times a step, so the host time counts (a new pair of timing
            # events costs several times a reused pair; docs/performance-history.md): streams are
            # looked up once, and timing events reused once step_comm() has read them --
            # except inside a capture, where they are graph nodes that every replay records again
            # (and that order no streams: `join` is then a plain event of its own).
            capturing = torch.cuda.is_current_stream_capturing()
            start, end = timing_events() if capturing or not self.spare else self.spare.pop()
            join = torch.cuda.Event() if capturing else end
            compute, side = torch.cuda.current_stream(), self.side
            self.ready.record(compute)
            side.wait_event(self.ready)
            torch.cuda.set_stream(side)
            try:
                start.record(side)
                fn(group.pg).wait()
                if then is not None:
                    then()
                end.record(side)
                if capturing:
                    join.record(side)
            finally:
                torch.cuda.set_stream(compute)
            h = Handle(self, rec, None, None, events=(start, end), join=(compute, join))
            h.reuse = not capturing
        else:
            h = Handle(self, rec, fn(group.pg), then)
        h.bus_bytes = rec.nbytes * bus_factor(op, group.size)
        self.step_handles.append(h)
        if inline:
            h.wait()
        return h

    def step_comm(self) -> tuple[float, float]:
        """(seconds, bus bytes) of this step's collectives, summed; call after the step's results
        were used. Bus bytes / seconds is the step's effective busbw, comparable with bench comm's."""
        total, bus = 0.0, 0.0
        for h in self.step_handles:
            if h.events is not None:
                secs = h.events[0].elapsed_time(h.events[1]) / 1000.0
                if h.rec.t_end is None:
                    h.rec.t_end = h.rec.t_start + secs
                if h.reuse:
                    self.spare.append(h.events)
            elif h.rec.t_end is not None:
                secs = h.rec.t_end - h.rec.t_start
            else:
                continue
            total += secs
            bus += h.bus_bytes
        if self.replay_rec is not None:
            self.replay_rec.t_end = time.time()
            self.replay_rec = None
        self.step_handles = []
        return total, bus

    def replayed(self, handles: list[Handle], world: Group) -> None:
        """Call as a captured CUDA graph is replayed; `handles`: the collectives launched while it
        was captured. One flight record (on the world group) stands for them all, open until
        step_comm() (the step's results were used), and their timing events, which the replay
        records again, count for this step. (Collectives over one-rank groups have no events:
        there is nothing to time.)"""
        timed = [h for h in handles if h.events is not None]
        self.replay_rec = self._record("graph_replay", world, (len(timed),), "graph", sum(h.rec.nbytes for h in timed))
        self.step_handles += timed

    def _record(self, op, group: Group, shape, dtype, nbytes, what="") -> Record:
        name = group.name
        if name not in self.gseq:
            self.gseq[name], self.members[name] = 0, list(group.ranks)
        rec = Record(self.seq, op, name, self.gseq[name], shape, dtype, nbytes, time.time(), step=self.step, what=what)
        self.seq += 1
        self.gseq[name] += 1
        self.records.append(rec)
        return rec

    def _sync(self, op: str, group: Group, fn):
        """Run a blocking collective that has no tensor of ours (a barrier, an object gather) and
        record it like the others, so that the flight log has no holes."""
        rec = self._record(op, group, (), "object", 0)
        out = fn() if group.pg is not None else None
        rec.t_end = time.time()
        return out

    def barrier(self, group: Group) -> None:
        if self.abort is not None and not self.cuda:  # (live recovery: gloo's barrier cannot be abandoned)
            self.all_reduce(torch.zeros(1), group).wait()
            return
        # (NCCL would otherwise guess the GPU from the rank, and warn about it)
        kw = {"device_ids": [self.device.index]} if self.cuda and group.pg is dist.group.WORLD else {}
        self._sync("barrier", group, lambda: dist.barrier(group=group.pg, **kw))

    def ordered_sum(self, x: float, group: Group) -> float:
        """x summed over the group's members in group order, in float64 on the host: the same bits
        on every member (an all_reduce's order of addition depends on the backend's algorithm)."""
        rows = self.gather_rows(torch.tensor([float(x)], dtype=torch.float64, device=self.device), group)
        total = 0.0
        for v in rows.flatten().tolist():
            total += v
        return total

    def all_gather_object(self, obj, group: Group) -> list:
        """Every member's (picklable) obj, in group order."""
        if self.abort is not None and not self.cuda and group.pg is not None:  # (live recovery: abandonable)
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            sizes = self.gather_rows(torch.tensor([data.numel()]), group).flatten().tolist()
            rows = self.gather_rows(torch.cat([data, data.new_zeros(max(sizes) - data.numel())]), group)
            return [pickle.loads(row[:n].numpy().tobytes()) for row, n in zip(rows, sizes)]
        out = [obj] * group.size
        self._sync("all_gather_object", group, lambda: dist.all_gather_object(out, obj, group=group.pg))
        return out

    def broadcast_object(self, obj, group: Group, src: int = 0):
        """The (picklable) obj of group member `src`, on every member."""
        box = [obj]
        self._sync("broadcast_object", group, lambda: dist.broadcast_object_list(box, src=group.global_rank(src),
                                                                                 group=group.pg))
        return box[0]

    def dump(self, path: str, header: dict | None = None) -> None:
        """Write the ring buffer as JSON lines (after an optional header line, to which the
        members of every group recorded are added), atomically. Safe to call from another thread
        while this one is blocked in a collective."""
        for h in list(self.step_handles):  # finished, though nobody waited for it yet
            try:
                if h.events is not None and h.rec.t_end is None and h.events[1].query():  # CUDA: its end event
                    h.rec.t_end = h.rec.t_start + h.events[0].elapsed_time(h.events[1]) / 1000.0
                elif h.rec.t_end is None and h.rec.what.startswith("send") and h.work is not None \
                        and h.work.is_completed():
                    h.rec.t_end = time.time()  # a host backend's send, left to complete: done by now
                    # (not a collective: a failed one is completed too, and it is where the rank was)
            except RuntimeError:
                pass
        records = list(self.records)  # one C call under the GIL: a consistent copy
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            if header is not None:
                f.write(json.dumps({**header, "groups": dict(self.members)}) + "\n")
            for r in records:
                f.write(r.to_json() + "\n")
        os.replace(tmp, path)

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, t, group: Group, op=dist.ReduceOp.SUM, inline=False) -> Handle:
        return self._launch("all_reduce", group, t, lambda g: dist.all_reduce(t, op=op, group=g, async_op=True),
                            inline=inline)

    def reduce_scatter(self, out, inp, group: Group, then=None, inline=False) -> Handle:
        if group.pg is None and out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        if self.abort is not None and group.pg is not None and not self.cuda:
            # Live recovery must be able to abandon every wait, and gloo's reduce-scatter cannot be
            # (torch 2.13: its wait ignores a timeout, and a failed one never reads as completed):
            # an all-to-all of the slices, then their sum, instead.
            recv = torch.empty_like(inp)

            def summed():
                out.copy_(pairwise_sum(recv.view(group.size, -1)))
                if then is not None:
                    then()

            return self._launch("reduce_scatter", group, inp,
                                lambda g: dist.all_to_all_single(recv, inp, group=g, async_op=True), then=summed)
        return self._launch("reduce_scatter", group, inp, lambda g: _reduce_scatter(out, inp, group=g, async_op=True),
                            then=then, inline=inline)

    def all_gather(self, out, inp, group: Group, inline=False) -> Handle:
        if group.pg is None and out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return self._launch("all_gather", group, out, lambda g: _all_gather(out, inp, group=g, async_op=True),
                            inline=inline)

    def broadcast(self, t, group: Group, src: int) -> Handle:
        """Group member `src`'s t on every member of group (in place)."""
        return self._launch("broadcast", group, t, lambda g: dist.broadcast(t, group.global_rank(src), group=g,
                                                                            async_op=True))

    def all_to_all(self, out, inp, group: Group) -> Handle:
        if group.pg is None:
            out.copy_(inp)
        return self._launch("all_to_all", group, inp,
                            lambda g: dist.all_to_all_single(out, inp, group=g, async_op=True))

    def all_to_all_v(self, out, inp, out_splits: list[int], in_splits: list[int], group: Group) -> Handle:
        """Rows of `inp` in runs of in_splits[i] to group index i; out receives out_splits[j] rows
        from index j, in index order (the experts' dispatch: parallel/expert.py). On the critical
        path: on CUDA issued on the compute stream and waited for there (inline)."""
        if group.pg is None:
            out.copy_(inp)
        return self._launch("all_to_all", group, inp, lambda g: dist.all_to_all_single(
            out, inp, out_splits, in_splits, group=g, async_op=True), inline=self.cuda)

    def send_recv(self, send, recv, to: int, frm: int, group: Group, direct: bool = False) -> Handle:
        """Send `send` to group index `to` while receiving `recv` from group index `frm`, posted
        together (batch_isend_irecv) so that a ring of them cannot deadlock. `direct` (the cp
        ring): on CUDA issued from the compute stream, not queued on the side stream behind the
        gradients' collectives; wait() makes the compute stream wait for it."""
        def fn(g):
            ops = [dist.P2POp(dist.isend, send, group.global_rank(to), g),
                   dist.P2POp(dist.irecv, recv, group.global_rank(frm), g)]
            return AllWorks(dist.batch_isend_irecv(ops))

        if group.pg is None:
            recv.copy_(send)
        elif self.abort is not None and not self.cuda:  # (live recovery: abortable_p2p)
            return self._launch("send_recv", group, send, abortable_p2p(send, recv, to, frm, group))
        return self._launch("send_recv", group, send, fn, direct=direct)

    def transfer(self, tensor, group: Group, what: str) -> Handle:
        """A pipeline transfer on a group of one direction (mesh.p2p): this rank sends `tensor` if
        it is the group's first member, else receives into it. Recorded as 'p2p' on both ends, so
        that the k-th record of the group is the same transfer on both."""
        send = group.index == 0
        other = group.global_rank(1 - group.index)

        def fn(g):
            return (dist.isend if send else dist.irecv)(tensor, other, group=g)

        if self.abort is not None and not self.cuda:  # (live recovery: abortable_p2p)
            fn = abortable_p2p(*((tensor, None) if send else (None, tensor)), 1, 0, group)

        # On CUDA not through the side stream, where each operation waits for the one before: a
        # send held there until its peer receives would hold up the receive this rank posts next,
        # while the peer does the mirror image (1F1B's steady state) -- a deadlock. A receive is
        # waited for at once, by the compute stream (inline); a send is issued from the compute
        # stream and left to complete (the executor waits for it before the step ends).
        return self._launch("p2p", group, tensor, fn, what=f"{'send' if send else 'recv'} {what}",
                            inline=self.cuda and not send, direct=send)

    def exact_reduce_scatter(self, out, inp, scratch, group: Group) -> Handle:
        """Sum `inp` (n equal slices, one per rank) over the group into this rank's slice `out`,
        bitwise the same for any power-of-two n: all-to-all moves slice r of every rank to rank r
        (the bandwidth of a reduce-scatter), then the n pieces are added along a complete binary
        tree in rank order (the group's `tree` order, if it has one) -- the top levels of the one tree
        over all micro-batches."""
        n = group.size

        def tree_sum():
            pieces = list(scratch.chunk(n)) if n > 1 else [inp]
            if group.tree and n > 1:  # (the replicas under cp: cp-major, mesh.py)
                pieces = [pieces[i] for i in group.tree]
            while len(pieces) > 1:
                pieces = [a.add_(b) for a, b in zip(pieces[0::2], pieces[1::2])]
            out.copy_(pieces[0])

        return self._launch("exact_reduce_scatter", group, inp,
                            lambda g: dist.all_to_all_single(scratch, inp, group=g, async_op=True), then=tree_sum)

    def gather_rows(self, values: torch.Tensor, group: Group) -> torch.Tensor:
        """All-gather a small tensor (same length on every rank); returns (group size, len)."""
        if group.pg is None:
            return values.unsqueeze(0)
        out = torch.empty(group.size * values.numel(), dtype=values.dtype, device=values.device)
        self.all_gather(out, values, group).wait()
        return out.view(group.size, -1)


def abortable_p2p(send, recv, to: int, frm: int, group):
    """Under live recovery on gloo, a send to group index `to` and a receive from `frm` (either may
    be None) as an all-to-all whose other parts are empty: gloo's own send and receive, waited for
    with a timeout, close the connection (torch 2.13), so live recovery could not abandon them.
    Every member of the group must take part (a pipeline's pair, a cp ring). Returns comm's fn.
    (The splits go by the process group's order of its ranks, torch's: sorted, unlike a pipeline
    pair's `ranks`, which go from sender to receiver.)"""
    order = sorted(group.ranks)
    ins, outs = [0] * group.size, [0] * group.size
    have = send if send is not None else recv
    src, dst = (have.new_empty(0) if t is None else t.view(-1) for t in (send, recv))
    ins[order.index(group.ranks[to])], outs[order.index(group.ranks[frm])] = src.numel(), dst.numel()
    return lambda g: dist.all_to_all_single(dst, src, outs, ins, group=g, async_op=True)


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum along dim 0 by a complete binary tree (padded with zeros to a power of two). Adding
    zero leaves never changes the result, so the value depends only on the non-zero prefix."""
    n = x.shape[0]
    size = 1 << max(0, (n - 1).bit_length())
    if size != n:
        x = torch.cat([x, x.new_zeros((size - n, *x.shape[1:]))])
    while x.shape[0] > 1:
        x = x[0::2] + x[1::2]
    return x[0]
