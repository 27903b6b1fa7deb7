"""Schedules as data, and the executor that runs them (docs/design-notes.md, "One validator, one
table, one schedule").

A schedule is a plain list of actions per pipeline rank (parallel/actions.py), generated for
every rank at once and checked before anything runs.

With one stage the schedule is the micro-batch loop, F0 B0 F1 B1 ...; with a pipeline,
parallel/pipeline.py makes them. Any order that runs each micro-batch's forward before its
backward is valid for the engine (parallel/engine.py): 1F1B's F0 F1 B0 F2 B1 ... gives the same
gradients -- within rounding by default, to the bit in exact mode.

The executor runs one rank's list: it tells the engine which micro-batch each forward and
backward belongs to and which backward is its chunk's last of the step, keeps each micro-batch's
output until its backward, sends and receives (each direction on its own group: sends are left
to complete, receives waited for), counts the activations alive at once (`max_live`) and times
each piece of work (`events`, for the bubble and `braidtrain plot --schedule`).
"""

from __future__ import annotations

import time

import torch

from braidtrain.parallel import pipeline, zb
from braidtrain.parallel.actions import Action, check, sequential


def build(name: str, n_micro: int, pp: int = 1, virtual: int = 1) -> list[list[Action]]:
    """The named schedule for every pipeline rank, checked."""
    if name == "sequential":
        plan = sequential(n_micro)
        check(plan, n_micro)
        return plan
    return pipeline.build(name, pp, virtual, n_micro)


class Executor:
    """Runs one rank's actions. `forward(stage, micro, inp)` runs chunk `stage` on micro-batch
    `micro` (`inp`: the received activation, None on the first chunk) and returns its output --
    on the last chunk the micro-batch's loss sum, backpropagated divided by `divisor` (the global
    token count). With a pipeline: `p2p[(from, to)]` the transfer groups (mesh.p2p), `pp` and
    `chunks` (pp * virtual), `shape` and `dtype` of the activations that move between chunks."""

    def __init__(self, engine, forward, divisor=1, *, p2p=None, pp=1, chunks=1, shape=None, dtype=torch.float32):
        self.engine, self.forward, self.divisor = engine, forward, divisor
        self.p2p, self.pp, self.chunks, self.shape, self.dtype = p2p or {}, pp, chunks, shape, dtype
        self.max_live = 0
        self.events: list[tuple] = []  # (op, stage, micro, start, end) of each piece of work, this step

    def run(self, actions: list[Action], n_micro: int, train: bool = True) -> list:
        """The step's micro-batches on this rank; returns the last chunk's outputs (loss sums) by
        micro-batch number (the canonical order, whatever order they ran in), zeros on a rank
        without it. `train=False`: forwards only (validation, sampling), the engine's step left be."""
        e, comm = self.engine, self.engine.comm
        finals = {a.stage: i for i, a in enumerate(actions) if a.op in ("B", "W")}  # each chunk's last backward
        split = any(a.op == "W" for a in actions)
        inputs, outputs, grads, weights, sends = {}, {}, {}, {}, []
        losses = [torch.zeros((), device=e.device)] * n_micro
        self.max_live, self.events = 0, []
        self.started = self._clock()
        if train:
            e.begin_step(n_micro)
        for i, a in enumerate(actions):
            key, first, last = (a.stage, a.micro), a.stage == 0, a.stage == self.chunks - 1
            if a.op in ("RECV_F", "RECV_B"):
                buf = torch.empty(self.shape, dtype=self.dtype, device=e.device)
                comm.transfer(buf, self._group(a), self._what(a)).wait()
                (inputs if a.op == "RECV_F" else grads)[key] = buf.requires_grad_(a.op == "RECV_F")
            elif a.op in ("SEND_F", "SEND_B"):
                # (sp, b > 1: a slice)
                t = (outputs[key].detach() if a.op == "SEND_F" else inputs.pop(key).grad).contiguous()
                sends.append(comm.transfer(t, self._group(a), self._what(a)))
                if not train and a.op == "SEND_F":
                    del outputs[key]
                for h in sends:  # let go of what was sent once it is (the backend holds it till then)
                    if h.ready():
                        h.wait()
                sends = [h for h in sends if not h.done]
            elif a.op == "F":
                start = self._clock()
                with e.forward(a.micro):
                    outputs[key] = self.forward(a.stage, a.micro, inputs.get(key))
                self._timed(a, start)
                if last:
                    losses[a.micro] = outputs[key].detach()
                self.max_live = max(self.max_live, len(outputs))
                if not train:  # forwards only: nothing is kept for a backward
                    inputs.pop(key, None)
                    if last:
                        del outputs[key]
            elif a.op == "B":
                start = self._clock()
                out, grad = outputs[key], grads.pop(key, None)
                tensors = out / self.divisor if last else out
                if split and not first:  # zb's B: the input's gradient now, the weights' at W
                    with e.input_phase():
                        dinp, weights[key] = zb.backward_input(tensors, grad, inputs[key])
                    inputs[key].grad = dinp
                elif split:  # the first chunk sends nothing back: all of its backward waits for W
                    weights[key] = (tensors, grad)
                else:
                    del outputs[key]
                    e.backward(a.micro, tensors, grad, last=i == finals[a.stage], stage=a.stage)
                out = tensors = grad = None  # (the graph lives in weights[key] until W, or not at all)
                self._timed(a, start)
            elif a.op == "W":
                start = self._clock()
                del outputs[key]
                w = weights.pop(key)
                if first:
                    e.backward(a.micro, *w, last=i == finals[a.stage], stage=a.stage)
                else:
                    e.backward_weight(a.micro, w, last=i == finals[a.stage], stage=a.stage)
                w = None
                self._timed(a, start)
        for h in sends:
            h.wait()
        self.ended = self._clock()
        return losses

    def _group(self, a: Action):
        """The transfer group of a's direction: to or from the rank of the chunk after / before."""
        me = a.stage % self.pp
        other = (a.stage + (1 if a.op in ("SEND_F", "RECV_B") else -1)) % self.pp
        return self.p2p[(me, other) if a.op.startswith("SEND") else (other, me)]

    @staticmethod
    def _what(a: Action) -> str:
        """The tensor, named alike on both ends: the activation chunk j outputs, or the gradient of it."""
        j = a.stage if a.op in ("SEND_F", "RECV_B") else a.stage - 1
        return f"{'act' if a.op.endswith('_F') else 'grad'} chunk {j} micro {a.micro}"

    def _clock(self):
        """A clock reading, for the pipeline's bubble and timeline; none at pp 1 (no events on the
        default path, nor inside a captured CUDA graph)."""
        if self.pp == 1:
            return None
        if self.engine.comm.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _timed(self, a: Action, start) -> None:
        if start is not None:
            self.events.append((a.op, a.stage, a.micro, start, self._clock()))

    def seconds(self, t) -> float:
        """A clock reading of the last run as seconds from its start (on CUDA, once it is done)."""
        return self.started.elapsed_time(t) / 1e3 if self.engine.comm.cuda else t - self.started

    def busy(self) -> tuple[float, float]:
        """(seconds of work, seconds from the run's start to its end) of the last run on this
        rank: a later stage's wait for its first input counts as idle, as does the first stage's
        for its last gradients. On CUDA, call once the step's work is done."""
        if not self.events:
            return 0.0, 0.0
        return sum(self.seconds(t) - self.seconds(s) for *_, s, t in self.events), self.seconds(self.ended)
