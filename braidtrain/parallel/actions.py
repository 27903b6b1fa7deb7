"""A schedule's actions, and the one-stage schedule: the micro-batch loop (schedule.py runs
them; parallel/pipeline.py makes a pipeline's).

    F(stage, micro)        forward of one micro-batch through pipeline chunk `stage`
    B(stage, micro)        its backward (zb: only the gradient of the chunk's input)
    W(stage, micro)        zb: the chunk's weight gradients (parallel/zb.py)
    SEND_F / RECV_F        the chunk's output to the next chunk's rank / its input from the previous
    SEND_B / RECV_B        its input's gradient to the previous chunk's rank / its output's from the next
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    op: str  # F, B, W, SEND_F, RECV_F, SEND_B, RECV_B
    stage: int
    micro: int

    def __repr__(self) -> str:
        return f"{self.op}{self.micro}" + (f"@{self.stage}" if self.stage else "")


def sequential(n_micro: int) -> list[list[Action]]:
    """The one stage's loop: forward then backward, micro-batch by micro-batch."""
    return [[Action(op, 0, m) for m in range(n_micro) for op in "FB"]]


def check(plan: list[list[Action]], n_micro: int) -> None:
    """One stage: each micro-batch's forward once and then, later, its backward once. Raises
    ValueError naming the first action that breaks this."""
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
