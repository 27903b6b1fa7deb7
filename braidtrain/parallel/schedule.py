"""Schedules as data, and the executor that runs them (docs/design-notes.md, "One validator, one
table, one schedule").

A schedule is a plain list of actions per pipeline stage, generated for every stage at once and
checked before anything runs:

    F(stage, micro)   forward of one micro-batch through the stage
    B(stage, micro)   its backward (later: split into input-gradient and weight-gradient parts,
                      and the send/recv of activations and gradients between stages)

The default schedule (one stage) is the micro-batch loop: F0 B0 F1 B1 ... Any other order that
runs each micro-batch's forward before its backward is valid for the engine (parallel/engine.py):
1F1B's F0 F1 B0 F2 B1 ... holds two micro-batches' activations at once, and gives the same
gradients -- within rounding by default, to the bit in exact mode.

The executor runs one stage's list: it tells the engine which micro-batch each forward and
backward belongs to and which backward is the step's last, keeps each micro-batch's output until
its backward, and counts the activations alive at once (`max_live`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    op: str  # "F" or "B"
    stage: int
    micro: int

    def __repr__(self) -> str:
        return f"{self.op}{self.micro}" + (f"@{self.stage}" if self.stage else "")


def sequential(n_micro: int, stages: int = 1) -> list[list[Action]]:
    """Today's loop, for each stage: forward then backward, micro-batch by micro-batch."""
    return [[Action(op, s, m) for m in range(n_micro) for op in "FB"] for s in range(stages)]


SCHEDULES = {"sequential": sequential}


def build(name: str, n_micro: int, stages: int = 1) -> list[list[Action]]:
    """The named schedule for every stage, checked."""
    plan = SCHEDULES[name](n_micro, stages)
    check(plan, n_micro)
    return plan


def check(plan: list[list[Action]], n_micro: int) -> None:
    """Every stage runs each micro-batch's forward once and then, later, its backward once.
    Raises ValueError naming the first action that breaks this."""
    for s, actions in enumerate(plan):
        seen = {"F": set(), "B": set()}
        for a in actions:
            if a.op not in seen or a.stage != s or not 0 <= a.micro < n_micro:
                raise ValueError(f"stage {s}: {a!r} is not an action of this stage's {n_micro} micro-batches")
            if a.micro in seen[a.op]:
                raise ValueError(f"stage {s}: {a!r} runs twice")
            if a.op == "B" and a.micro not in seen["F"]:
                raise ValueError(f"stage {s}: {a!r} comes before its forward")
            seen[a.op].add(a.micro)
        missing = [f"{op}{m}" for op in "FB" for m in range(n_micro) if m not in seen[op]]
        if missing:
            raise ValueError(f"stage {s}: never runs {', '.join(missing)}")


class Executor:
    """Runs one stage's actions. `forward(micro)` returns the micro-batch's loss sum, which is
    backpropagated divided by `divisor` (the global token count); the engine gets each forward
    and backward in the order the schedule says."""

    def __init__(self, engine, forward, divisor=1):
        self.engine, self.forward, self.divisor = engine, forward, divisor
        self.max_live = 0

    def run(self, actions: list[Action], n_micro: int) -> list:
        """The step's micro-batches on this stage; returns their outputs' detached values by
        micro-batch number (the canonical order, whatever order they ran in)."""
        last_backward = max(i for i, a in enumerate(actions) if a.op == "B")
        live, out = {}, [None] * n_micro
        self.max_live = 0
        self.engine.begin_step(n_micro)
        for i, a in enumerate(actions):
            if a.op == "F":
                with self.engine.forward(a.micro):
                    live[a.micro] = self.forward(a.micro)
                self.max_live = max(self.max_live, len(live))
            else:
                loss = live.pop(a.micro)
                out[a.micro] = loss.detach()
                self.engine.backward(a.micro, loss / self.divisor, last=i == last_backward)
        return out
