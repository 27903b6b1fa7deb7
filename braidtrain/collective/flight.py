"""A collective in flight: its record in the flight log (Record), its Handle, and how it is waited
for -- on CUDA by the stream that launched it, on a host backend by the host, in slices when live
recovery may abort it (Aborted; a send and a receive then go as an all-to-all: comm.py's abortable_p2p)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch


def timing_events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """A start/end pair of CUDA timing events. Recorded inside a graph capture they become graph
    nodes (external events), so every replay records them again and they time that replay."""
    external = torch.cuda.is_current_stream_capturing()
    return tuple(torch.cuda.Event(enable_timing=True, external=external) for _ in range(2))


@dataclass
class Record:
    seq: int  # this rank's count of operations, every group together
    op: str
    group: str  # the group's name (group_name)
    gseq: int  # the group's count: the same operation has the same gseq on every member
    shape: tuple
    dtype: str
    nbytes: int
    t_start: float  # time.time() at launch
    t_end: float | None = None  # when the result was ready (host clock), None while in flight or failed
    step: int = 0  # the training step (1-based) it belongs to; 0 before the first
    what: str = ""  # a pipeline transfer: which tensor ("send act c0 m3")

    def to_json(self) -> str:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return json.dumps(d)


class Handle:
    """An in-flight collective. `wait()` returns once its result may be used (on CUDA: by the work
    queued after it on the stream that launched it, which is made to wait); `then` (optional)
    is the follow-up that consumes the result (the exact reduce-scatter's tree sum, ZeRO-2's
    accumulation): on CUDA it is queued on the side stream right behind the collective, on a host
    backend it runs at wait()."""


    def __init__(self, comm, rec: Record, work, then=None, events=None, join=None):
        self.comm, self.rec, self.work, self.then, self.events = comm, rec, work, then, events
        self.join = join  # CUDA: (the stream that launched it, the event that stream waits for)
        self.done = False
        self.reuse = False  # CUDA: its timing events may be recorded again once read
        if work is not None and events is None:
            # Host backends (gloo) complete on their own thread: record the real completion time
            # (some gloo collectives have no future; their end is then taken at wait()).
            try:
                work.get_future().then(self._mark_if_ok)
            except RuntimeError:
                pass
        elif events is None:
            self._mark()


    def _mark(self):
        if self.rec.t_end is None:
            self.rec.t_end = time.time()


    def _mark_if_ok(self, fut):
        try:  # a collective that failed (a peer died) stays open in the flight log
            fut.value()
        except Exception:
            return
        self._mark()


    def ready(self) -> bool:
        """True when wait() would not block the host."""
        return self.done or self.work is None or self.work.is_completed()


    def wait(self):
        if self.done:
            return
        if self.work is not None:
            if self.comm.abort is None:
                self.work.wait()
            else:
                _wait_abortable(self.work, self.comm.abort)
        if self.join is not None:
            stream, event = self.join
            stream.wait_event(event)
        elif self.events is None:
            self._mark()
        if self.then is not None:
            self.then()
        self.done = True
        self.work = None  # the backend's hold on the tensors (a send's, a receive's buffer) goes too


class Aborted(RuntimeError):
    """A wait given up because a peer was lost (live recovery: Comm.abort was set)."""


def _wait_abortable(work, abort) -> None:
    """work.wait(), in slices of 0.1 s, giving up (Aborted) once `abort` is set: a collective that
    waits on a lost peer may never end, and live recovery must get this thread back."""
    while True:
        if abort.is_set() and not work.is_completed():
            raise Aborted("a peer was lost: this collective was abandoned")
        try:
            work.wait(timedelta(seconds=0.1))
            return
        except RuntimeError:
            if work.is_completed():  # done meanwhile, or failed itself (a peer's connection closed)
                work.wait()
                return


class AllWorks:
    """Several works (a batch of point-to-point ops) waited on as one."""


    def __init__(self, works):
        self.works = works


    def wait(self, timeout=None):
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True


    def is_completed(self):
        return all(w.is_completed() for w in self.works)


    def get_future(self):
        raise RuntimeError("no single future")  # Handle then takes the end time at wait()
