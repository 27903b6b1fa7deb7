"""BRAIDTRAIN_FAULT: a test hook that makes a rank fail on purpose, for the fault-tolerance tests
and benchmarks only (docs/fault-tolerance.md, "Test hook")."""

from __future__ import annotations

import errno
import os
import signal
import time

import torch

from braidtrain.collective.fault import say
from braidtrain.errors import UserError

FAULT_KINDS = {
    "kill": "SIGKILL this rank in the middle of the step (after its first micro-batch's forward)",
    "stop": "SIGSTOP (freeze) this rank at the same point",
    "kill-late": "SIGKILL this rank after it applied the step's update, before the step's loss is summed "
                 "(--live-recovery)",
    "fail-update": "fail this rank's wait as if a peer were lost just before it applies the step's update: a "
                   "survivor left one update behind (--live-recovery)",
    "misjudge": "at the start of that step this rank's heartbeat judges the next member lost although it beats: a "
                "verdict that proves false, as a stall just over --heartbeat-timeout makes one; step -x + 1: after the "
                "last step, in the final save; -x + 2: after the run's final collective, once rank 0 has written "
                "summary.json (a rank other than 0; --live-recovery)",
    "save": "fail the checkpoint save of that step after this rank's file is written (ENOSPC)",
    "slow-save": "sleep `seconds` in the middle of that step's checkpoint save",
    "nan": "make this rank's loss of that step NaN (a last pipeline stage's rank)",
    "nan-on": "make this rank's loss NaN from that step on",
    "oom": "raise torch's out-of-memory error in the middle of that step",
    "local-disk": "at the first checkpoint save, leave this rank's marker in a folder of its own (a node-local disk)",
    "hold-offload": "from that step on, the host updates a bucket only once the run asks for its weights "
                    "(--offload optimizer): whatever reads them without waiting finds them stale",
}


class Fault:
    """BRAIDTRAIN_FAULT="KIND:step=S[:rank=R][:seconds=X]" -- a *test hook*, for the fault-tolerance
    tests and benchmarks only. It fires once, at step S (1-based), on rank R (default: every rank),
    and only on torchrun's first attempt, so that the restarted group runs clean."""

    def __init__(self, spec: str):
        kind, *fields = spec.split(":")
        if kind not in FAULT_KINDS:
            raise UserError(f"BRAIDTRAIN_FAULT={spec!r}: unknown kind {kind!r}: use one of {', '.join(FAULT_KINDS)}")
        opts = {}
        for f in fields:
            k, _, v = f.partition("=")
            if k not in ("step", "rank", "seconds") or not (v.replace(".", "", 1) if k == "seconds" else v).isdigit():
                raise UserError(f"BRAIDTRAIN_FAULT={spec!r}: expected KIND:step=S[:rank=R][:seconds=X], got {f!r}")
            opts[k] = float(v) if k == "seconds" else int(v)
        if "step" not in opts:
            raise UserError(f"BRAIDTRAIN_FAULT={spec!r}: say at which step, e.g. {kind}:step=4")
        self.kind, self.step, self.rank, self.seconds = kind, opts["step"], opts.get("rank"), opts.get("seconds", 5.0)

    @staticmethod
    def from_env(rank: int, attempt: int) -> Fault | None:
        spec = os.environ.get("BRAIDTRAIN_FAULT")
        if not spec:
            return None
        fault = Fault(spec)  # parsed on every rank and attempt: a typo is an error everywhere
        return fault if attempt == 0 and fault.rank in (None, rank) else None

    def _announce(self, what: str) -> None:
        say(f"braidtrain: fault injected: {what} at step {self.step} (t={time.time():.3f})")

    def mid_step(self, step: int) -> None:
        if step == self.step and self.kind == "oom":
            self._announce("out of memory")
            raise torch.OutOfMemoryError("CUDA out of memory (injected by BRAIDTRAIN_FAULT)")
        if step == self.step and self.kind in ("kill", "stop"):
            sig = signal.SIGKILL if self.kind == "kill" else signal.SIGSTOP
            self._announce(f"{sig.name} pid {os.getpid()}")
            os.kill(os.getpid(), sig)

    def poison(self, step: int, loss):
        """The loss, NaN at the step(s) a "nan" or "nan-on" fault names."""
        if (self.kind == "nan" and step == self.step) or (self.kind == "nan-on" and step >= self.step):
            return loss + float("nan")
        return loss

    def holds_offload(self, step: int) -> bool:
        return self.kind == "hold-offload" and step >= self.step

    def mid_save(self, step: int) -> None:
        if step == self.step and self.kind == "save":
            self._announce("checkpoint save fails")
            raise OSError(errno.ENOSPC, f"No space left on device (injected by BRAIDTRAIN_FAULT, step {step})")
        if step == self.step and self.kind == "slow-save":
            self._announce(f"checkpoint save sleeps {self.seconds:g} s")
            time.sleep(self.seconds)
