"""The state after a change of members: brought level, laid out over the new world, checked.

- Level. A loss inside the step's last collective may strike after some survivors applied the
  step's update and before others did. Those that did report the update's clip scale and skip
  flag with their "here" (members.py); those behind apply the same update with them (catch_up) --
  every input of it is already theirs: a rank that applied had finished the step's last
  collective, which needed every rank's part, so every rank had its reduced gradient by then.
- ZeRO-0: every rank holds the whole state; a joiner takes it from process-group rank 0 by
  broadcast, checked against its sha256 (sync_state).
- ZeRO 1-3: each member's shard has a buddy copy (parallel/mirror.py); on any change every bucket
  is re-laid out over the new members from its holders (reshard), every member hashes what it
  assembled and the hashes must agree.
A copy that does not check out is one line: a joiner leaves (the others lose it like any rank),
a member falls back to the checkpoint restart.
"""

from __future__ import annotations

import hashlib

import torch

from braidtrain.collective.fault import EXIT_PEER_LOST
from braidtrain.optim import lr_at
from braidtrain.parallel import mirror


class Transfer:
    """LiveTrainer's state transfers (a mixin: it reads the trainer's engine, opt, comm, mesh, ids
    and mirror, and calls its fall_back)."""

    def catch_up(self, step: int, update: dict) -> None:
        """Apply step `step`'s update as the members ahead did (their clip scale and skip flag)."""
        cfg, dev = self.cfg, self.device
        self.opt.prepare(lr_at(step, lr=cfg.lr, warmup=cfg.warmup_steps, max_steps=cfg.max_steps,
                               final_frac=cfg.final_lr_frac))
        scale = None if update["scale"] is None else torch.tensor(update["scale"], dtype=torch.float32, device=dev)
        self.update(scale, torch.tensor(update["skip"], dtype=torch.float32, device=dev))

    # -- ZeRO-0: the whole state, from one rank --------------------------------------------------
    def state(self) -> list[torch.Tensor]:
        """Everything a ZeRO-0 rank holds that a step changes: the weights (a lean state's fp32
        masters too) and Adam's moments."""
        return ([b.data for b in self.engine.buckets] + [b.master for b in self.engine.buckets if b.apart]
                + [t for m, v, _ in self.opt.groups for t in (m, v)])

    def digest(self) -> str:
        h = hashlib.sha256(str(self.opt.step_count).encode())
        for t in self.state():
            h.update(t.detach().cpu().numpy().tobytes())
        return h.hexdigest()

    def sync_state(self, src: int) -> str:
        """Every member takes the state of process-group rank `src` (broadcast), checked against
        its sha256."""
        world = self.mesh.groups["world"]
        for t in self.state():
            self.comm.broadcast(t, world, src).wait()
        step_count, want = self.comm.all_gather_object((self.opt.step_count, self.digest()), world)[src]
        self.opt.step_count = step_count
        got = self.digest()
        if got != want:
            self.bad_copy(f"the state received from rank {self.ids[src]} has sha256 {got[:12]}, not its {want[:12]}")
        return got

    # -- ZeRO 1-3: the shards, from their holders -------------------------------------------------
    def reshard(self, old: list[int], held: dict) -> str:
        """The sharded state over the members now (mirror.reshard), from the members `old` of the
        layout before (this rank's holdings `held`); every member's hash of it compared -- within
        its replica group (under pp or tp the groups hold other parameters: replicas.py)."""
        group, me, g = self.mesh.groups["replica"], self.rt.rank, self.grid
        was = g.group(old, me)
        self.mirror, got = mirror.reshard(self.engine, self.opt, self.comm, group, len(was), held,
                                          mirror.holders(was, g.group(self.ids, me), g.cp), g.cp)
        seen = self.comm.all_gather_object((self.opt.step_count, got), group)
        self.opt.step_count, want = seen[0]  # (process-group rank 0: a member before, never a joiner)
        if got != want:
            self.bad_copy(f"the re-sharded state assembled here has sha256 {got[:12]}, rank {group.ranks[0]}'s "
                          f"{want[:12]}")
        return got

    def bad_copy(self, why: str) -> None:
        if self.arriving:  # a joiner that got a bad copy leaves: the others lose it like any rank
            self.guard.fatal(f"joining: {why}", EXIT_PEER_LOST)
        self.fall_back(why)
