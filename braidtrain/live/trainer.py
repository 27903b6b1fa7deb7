"""LiveTrainer: the training loop whose step survives the loss of a data-parallel rank -- or, under
pp, tp or cp, of a whole replica (replicas.py). The package docstring draws the protocol. A step
that fails in a collective because a peer was lost is recovered -- the members agreed (members.py),
the world rebuilt over them (replicas.py), the state brought level and laid out over them
(state.py) -- and done again with the lost ranks' micro-batches divided (redo.py); a joiner is let
in at a step boundary (grow). A step interrupted after some survivors applied its update is not
done twice: those behind apply the same update (state.catch_up).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch

from braidtrain.collective.flight import Aborted
from braidtrain.errors import UserError
from braidtrain.collective.fault import EXIT_PEER_LOST, say
from braidtrain.live import members
from braidtrain.live.join import build_joiner
from braidtrain.live.members import first_line, is_transport, ranks
from braidtrain.live.redo import Redo
from braidtrain.live.replicas import Grid, Replicas
from braidtrain.live.state import Transfer
from braidtrain.parallel import mirror
from braidtrain.train import Trainer


def check_config(cfg) -> None:
    """--live-recovery's one-line refusals, before anything starts."""
    if cfg.join and not cfg.live_recovery:
        raise UserError("--join adds a process to a job that runs with --live-recovery: give both")
    if cfg.ep != 1:
        raise UserError(f"--live-recovery does not recover expert parallelism, got --ep {cfg.ep}: an ep group spans "
                        f"{cfg.ep} replicas (carved from the dp axis), so a lost rank would break the other replicas' "
                        f"expert exchange too; drop --live-recovery (the checkpoint restart recovers it) or use --ep 1")
    others = [f"--{a} {getattr(cfg, a)}" for a in ("pp", "cp", "tp") if getattr(cfg, a) != 1]
    if cfg.join and others:
        raise UserError(f"--join replaces one data-parallel rank, and with {' '.join(others)} a lost rank retires its "
                        f"whole replica, whose ranks cannot join back live: drop --join")
    if cfg.heartbeat_timeout <= 0:
        raise UserError("--live-recovery finds frozen ranks by the heartbeat: give --heartbeat-timeout > 0")
    if cfg.device not in (None, "cpu") or (cfg.device is None and torch.cuda.is_available()):
        raise UserError("--live-recovery runs on CPU (gloo) only: NCCL's communicators would have to be aborted, "
                        "which is not built; drop --live-recovery (or use --device cpu)")
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("WORLD_SIZE", "1") != "1":
        raise UserError("--live-recovery under torchrun: its agents stop (and restart) every worker when one fails; "
                        "start one process per rank with -pi tcp or -pi fs instead (scripts/live.sh)")
    if cfg.join and (cfg.init_method != "tcp" or not cfg.process_rank):
        raise UserError("--join replaces a lost rank of a running job: give -pi tcp -ps ADDRESS (the job's), its -pn "
                        "and the lost rank's -pr (not 0: rank 0 hosts the store)")


class LiveTrainer(Redo, Transfer, Replicas, Trainer):
    """The training loop with live recovery. Ranks keep their numbers; `ids` are the members now,
    in process-group order, `replicas` the data-parallel indices left (replicas.py: under dp alone,
    the same)."""

    def __init__(self, cfg):
        super().__init__(cfg, build_joiner(cfg) if cfg.join else None)
        lay = self.layout  # (a joiner's: the job's first layout)
        self.on = cfg.live_recovery and (self.rt.world_size > 1 or cfg.join)
        self.grid = Grid(lay.pp, lay.dp, lay.cp, lay.tp)
        self.ids = list(range(lay.pp * lay.dp * lay.cp * lay.tp))
        self.replicas, self.replica = list(range(lay.dp)), self.grid.replica(self.rt.rank)
        self.D, self.m, self.b = lay.dp, self.batch.micro_steps, cfg.batch_size
        self.M = self.D * self.m  # micro-batches of a step
        self.plan = {i: list(range(i * self.m, (i + 1) * self.m)) for i in self.replicas}  # replica -> micro-batches
        self.epoch, self.degraded, self.recovering, self.noticed, self.cause = 0, False, False, None, None
        self.complete = False  # a recovery found the run complete (members.complete): nothing left to do
        self.marked = False  # (rank 0) it marked the run complete: past its last collective, it never falls back
        self.lock = threading.Lock()
        self.applied = None  # this step's update, once applied on this rank: its clip scale and skip flag
        self.arriving = False  # a joiner, taking its state
        self.report = None  # the first step after a change: what to say when it is done
        self.mirror = None  # ZeRO 1-3: this rank's copy of the next member's shard (parallel/mirror.py)
        self.joined: dict = {}  # ranks admitted at the next change, and at which step
        if self.on:
            self.comm.abort = threading.Event()
            self.guard.live = self
        if self.on and self.rt.is_main:
            self.rt.store.set("live/config", cfg.to_toml())  # what a joiner checks its flags against
        if cfg.join:
            adm = self.built.admission
            self.arrive(adm["epoch"], adm["members"], adm["add"], adm["step"])
        elif self.on and cfg.zero:
            self.mirror = mirror.Mirror(self.engine, self.opt, self.mesh.groups["replica"], stride=lay.cp)
            self.mirror.fill()

    # -- the watch threads' side (fault.Guard) ---------------------------------------------------
    def peer_lost(self, verdict: str) -> bool:
        """The heartbeat judged a peer lost: abort this rank's waits, and let the main thread
        recover -- unless it does not come within the grace (stuck where it cannot be interrupted):
        then False, and the guard falls back to the restart path. (Rank 0 past the last collective has
        no wait to be stuck in: no grace.)"""
        if self.recovering:
            return True
        now = time.monotonic()
        if self.noticed is None:
            self.noticed, self.cause = now, verdict
            self.comm.abort.set()
        return self.marked or now - self.noticed < 2 * self.cfg.heartbeat_timeout

    def poll(self, client) -> None:
        """(The heartbeat thread, every beat.) Another member began a recovery: abort our waits too."""
        e = self.epoch
        with self.lock:  # (rebuild clears both at once)
            late = not self.recovering and not self.marked and self.noticed is not None and \
                time.monotonic() - self.noticed > 2 * self.cfg.heartbeat_timeout
        if late:
            self.fall_back("this rank did not get back from where it waited (not a collective it can abandon)")
        if not self.comm.abort.is_set() and client.check([f"live/{e}/abort"]):
            cause = client.get(f"live/{e}/abort").decode()
            with self.lock:
                if e == self.epoch and not self.comm.abort.is_set():
                    self.cause, self.noticed = cause, self.noticed or time.monotonic()
                    self.comm.abort.set()

    # -- the step --------------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        if self.on and self.grid.alone and len(self.ids) < self.D:
            self.boundary(step)
        while True:
            count, self.applied = self.opt.step_count, None
            try:
                self.misjudge(step)
                rec = super().step(step)
                break
            except Exception as e:
                if not self.on or not is_transport(e):
                    raise
                if self.applied is None:
                    self.opt.step_count = count
                done = self.recover(step, e)
                if done > step:  # the update was applied everywhere: the step is done, its loss lost
                    rec = {"step": step + 1, "loss": float("nan"), "tokens_per_s": 0.0, "lost_in_flight": True}
                    break
        if self.report:
            rec.update(self.report)
            if self.rt.is_main:
                print(f"braidtrain: live: step {step + 1} completed by ranks {','.join(map(str, self.ids))} "
                      f"(t={time.time():.3f})", flush=True)
            self.report = None
        return rec

    def misjudge(self, step: int) -> None:
        """(The test hook "misjudge", collective/inject.py, once; step -x is the part after the last step,
        -x + 1 the moment after its last collective, once rank 0 is past it too: its summary written.)
        This rank's heartbeat judges the next member lost, and its first wait of the step is given up."""
        if self.fault and self.fault.kind == "misjudge" and step + 1 == self.fault.step:
            deadline = time.monotonic() + self.cfg.timeout
            while step > self.cfg.max_steps and not (self.out / "summary.json").exists() and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            peer = self.ids[(self.ids.index(self.rt.rank) + 1) % len(self.ids)]
            self.fault._announce(f"rank {peer} judged lost although it beats")
            self.fault = None
            self.peer_lost(f"rank {peer} sent no heartbeat for {self.cfg.heartbeat_timeout:.1f} s (dead or frozen)")
            raise Aborted("a peer was lost: this collective was abandoned")

    def reduced(self) -> None:
        if self.mirror is not None:  # the next member's reduced gradient shards, for the copy
            self.mirror.exchange()

    def update(self, grad_scale, skip) -> None:
        injected = self.fault and self.fault.kind == "fail-update" and self.comm.step == self.fault.step
        if injected and not self.recovering:
            self.fault._announce("a lost peer's error before the update")
            raise Aborted("a peer was lost (injected before the update)")
        super().update(grad_scale, skip)
        if self.mirror is not None:  # the next member's update, on the copy of its shards
            self.mirror.update(grad_scale, skip)
        self.applied = {"scale": None if grad_scale is None else grad_scale.item(), "skip": skip.item()}
        if self.fault and self.fault.kind == "kill-late" and self.comm.step == self.fault.step:
            self.fault._announce(f"SIGKILL pid {os.getpid()} after the update")
            os.kill(os.getpid(), signal.SIGKILL)

    def state_bytes(self) -> int:
        return super().state_bytes() + (self.mirror.bytes() if self.mirror is not None else 0)

    def _run(self) -> dict:
        try:
            summary = super()._run()
            if self.on and self.rt.is_main and self.grid.alone:  # a joiner still waiting will not be admitted now
                for r in range(1, self.D):
                    if self.rt.store.check([f"live/join/{r}"]):
                        self.rt.store.set(f"live/joined/{r}", json.dumps({"refused": f"the run ended at step "
                                                                                     f"{self.cfg.max_steps}"}))
            return summary
        except Exception as e:  # between steps (a checkpoint save, a validation): no live recovery there
            if self.on and is_transport(e):
                self.fall_back(f"a peer was lost outside a training step ({first_line(e)})")
            raise

    def finish(self, *last) -> dict:
        """After the last step, a peer lost -- or a verdict that proves false -- in the final save,
        validation or the weights' hash is recovered as in a step: every member has done every step
        (each took part in the last one's final collective), so the state is level; that part is done
        again over the members. A finished run does not fall back to a restart; nor does a member whose
        verdict comes after rank 0 is past the last collective (past_collectives)."""
        while True:
            try:
                self.misjudge(self.cfg.max_steps)
                return super().finish(*last)
            except Exception as e:
                if not self.on or not is_transport(e):
                    raise
                self.recover(self.cfg.max_steps - 1, e, finished=True)
                if self.complete:
                    return {"step": self.cfg.max_steps, "complete": True}  # (rank 0 wrote the run's summary)

    def past_collectives(self) -> None:
        """Rank 0 past the run's last collective, which needed every member's part: the run is complete.
        It says so in the store (members.complete), so that a member whose verdict comes now, before it
        has seen that collective complete, finds it and has nothing to do -- rather than judging rank 0
        lost as it leaves. From here rank 0 has only its own work left (the summary, the plot: on a
        loaded machine, seconds), so it no longer falls back for a wait it did not give up in time."""
        if self.on and self.rt.is_main:  # (marked: unless a recovery's decision came first -- then as before)
            self.marked = members.complete(self.rt.store, self.epoch)
        else:  # (the hook waits for rank 0's summary, which rank 0 writes after this: a member's hook only)
            self.misjudge(self.cfg.max_steps + 1)

    def end(self) -> None:
        """A peer lost in the run's last barrier: every member took part in every collective before it
        (the final checkpoint published, the summary written), so the run is complete -- one line, the
        silent peer ended as the heartbeat ends one, and exit 0."""
        if self.complete:  # (the world's group was given up: no barrier)
            self.guard.close(clean=True)
            return
        try:
            super().end()
        except Exception as e:
            if not self.on or not is_transport(e):
                raise
            self.recovering = True  # (nothing to recover: the heartbeat's threads stand down)
            why = self.cause or first_line(e)
            say(f"braidtrain: rank {self.rt.rank}: the run's last barrier was given up after the run was complete "
                f"({why}); nothing to recover")
            self.guard._end_frozen()
            self.guard.close(clean=True)

    def check_shared(self, ckpt_dir) -> None:
        if not self.degraded:  # (after a change, the ranks' markers are not 0..n-1)
            super().check_shared(ckpt_dir)

    def recover(self, step: int, err: BaseException, finished: bool = False) -> int:
        """Agree on the survivors, rebuild the world over them, bring them to one state; returns
        the number of steps that state has done (step: redo it; step + 1: it was done). `finished`:
        after the last step, `step` its index (every member has applied it)."""
        t0, me, e = time.time(), self.rt.rank, self.epoch
        self.recovering = True
        cause = (self.cause if isinstance(err, Aborted) else None) or f"rank {me}: {first_line(err)}"
        store = self.rt.store
        try:
            store.compare_set(f"live/{e}/abort", "", cause)  # wake the members still waiting
            self.guard.dump(f"live recovery: {cause}", self.out / "flight" / f"live-{e}" / f"rank_{me:05d}.jsonl")
            done = step + 1 if self.applied else step
            error = None if isinstance(err, Aborted) else first_line(err)  # (Aborted: this rank gave up a wait)
            store.set(f"live/{e}/here/{me}", json.dumps({"done": done, "pid": os.getpid(), "update": self.applied,
                                                         "error": error}))
            decision = members.agree(store, e, self.ids, self.guard, self.cfg.timeout, self.cfg.heartbeat_timeout,
                                     self.grid.replica)
        except Exception as x:  # the store is gone with rank 0, or never agreed
            self.fall_back(f"live recovery failed ({first_line(x)})")
        if decision.get("complete"):  # rank 0 had finished the run: every member was past every collective
            say(f"braidtrain: rank {me}: the run was complete when this rank gave up its wait ({cause}); nothing "
                f"to recover")
            self.complete = True
            return step + 1
        ids, lost = decision["members"], {int(k): v for k, v in decision["lost"].items()}
        here = sorted(int(p) for p in decision["pids"])  # (the members, and a retired replica's ranks)
        if me not in here:
            say(f"braidtrain: rank {me}: the others went on without this rank (judged lost); exiting")
            os._exit(EXIT_PEER_LOST)
        failed = {int(p): why for p, why in decision["errors"].items() if why}
        if not lost and failed:  # everyone is here: a collective failed, and not for a lost peer
            self.fall_back(f"{ranks(failed)}: a collective failed in step {step + 1} although no rank was lost "
                           f"({'; '.join(failed.values())})")
        # (No rank lost and none failed: a heartbeat verdict that proved false -- a member silent for the
        # timeout, a stall of its whole process, was back in time to say it is here. The waits it cost were
        # abandoned, which leaves the group unusable: it is rebuilt over the same members below, the step done
        # again, as after a loss.)
        old, target = self.ids, max(decision["done"].values())
        why = self.unrecoverable(old, ids, lost)
        if why:
            if self.rt.is_main:
                members.record(self.out, {"epoch": e + 1, "step": step + 1, "members": [], "lost": lost,
                                          "what": f"{ranks(lost)} lost; {why}: fell back to the checkpoint restart",
                                          "fallback": True, "time": time.time()})
            members.leave_together(store, e, here, me, self.cfg.heartbeat_timeout)  # (rank 0's store goes with it)
            self.fall_back(f"{ranks(lost)} lost: {why}")
        leaving = [p for p in here if p not in ids]
        if me in leaving:
            self.leave(lost, ids)
        if target > step and not finished:  # the update was applied by some: the others apply it too
            if self.applied is None:
                self.catch_up(step, decision["update"])
            if decision["update"]["skip"]:  # (a skipped step does not count in Adam's steps)
                self.opt.step_count -= 1
        held = self.mirror.holdings() if self.mirror is not None else None
        dp = self.layout.dp
        self.rebuild(e + 1, ids)
        if held is not None:
            self.reshard(old, held)
        secs = time.time() - t0
        retired = "" if self.grid.alone else self.retired(lost, leaving) + "; "
        again = (f"step {step + 1} done again" if target == step else f"step {step + 1} already applied"
                 + (" (the last: the final save and validation done again)" if finished else ""))
        if lost:
            what = (f"{ranks(lost)} lost ({'; '.join(lost.values())}); {retired}ranks {','.join(map(str, ids))} go "
                    f"on, world {len(old)} -> {len(ids)}" + ("" if self.grid.alone else f" (dp {dp} -> "
                                                                                        f"{self.layout.dp})")
                    + ", " + self.promoted(old, lost) + again)
        else:
            what = (f"no rank lost ({cause}, but every member said it is here); ranks {','.join(map(str, ids))} go "
                    f"on in a world made again, {again}")
        if self.rt.is_main:
            members.record(self.out, {"epoch": e + 1, "step": step + 1, "members": ids, "lost": lost, "what": what,
                                      "pids": {p: decision["pids"][p] for p in map(str, ids)}, "cause": cause,
                                      "time": time.time(), "recover_s": secs, **({} if self.grid.alone else {
                                          "retired": sorted({self.grid.replica(r) for r in lost}), "left": leaving})})
            print(f"braidtrain: live recovery at step {step + 1}: {what} ({secs:.1f} s)", flush=True)
        self.report = {"world_size": len(ids), "recover_s" if lost else "rebuilt_s": secs}
        return target

    def fall_back(self, why: str) -> None:
        self.guard._publish(f"rank {self.rt.rank}: {why}")
        self.guard.fatal(f"peer lost: {why}; falling back to the checkpoint restart", EXIT_PEER_LOST)

    # -- joiners ---------------------------------------------------------------------------------
    def boundary(self, step: int) -> None:
        """Before a step, while ranks are missing: rank 0 schedules the processes asking to join
        (live/join/RANK) for the step after next (live/grow/EPOCH): by then every member has read it,
        the step after this one being one they all take part in."""
        store, e = self.rt.store, self.epoch
        if self.rt.is_main and not self.joined:
            asking = [r for r in range(self.D) if r not in self.ids and store.check([f"live/join/{r}"])]
            if asking and step + 2 < self.cfg.max_steps:
                store.compare_set(f"live/grow/{e}", "", json.dumps({"step": step + 2, "add": asking}))
        if not self.joined and store.check([f"live/grow/{e}"]):
            self.joined = json.loads(store.get(f"live/grow/{e}"))
        if self.joined and step >= self.joined["step"]:
            self.grow(step)

    def grow(self, step: int) -> None:
        """The scheduled joiners in: admitted (live/joined/RANK: the new members, epoch, step and run),
        the world rebuilt over all, and the state sent to them -- ZeRO-0: from process-group rank 0;
        ZeRO 1-3: re-sharded over all -- checked by sha256."""
        t0, e, add, store = time.time(), self.epoch, self.joined["add"], self.rt.store
        old, ids = self.ids, sorted(self.ids + add)
        pids = {}
        if self.rt.is_main:
            for r in add:
                pids[r] = int(store.get(f"live/join/{r}"))
                store.set(f"live/joined/{r}", json.dumps({
                    "epoch": e + 1, "members": ids, "add": add, "step": step, "out": str(self.out),
                    "session": self.guard.session, "run_id": self.built.run_id, "max_steps": self.cfg.max_steps}))
                store.delete_key(f"live/join/{r}")
        for r in add:
            self.guard.where.pop(r, None)  # (the lost process's host:pid; the joiner posts its own)
        held = self.mirror.holdings() if self.mirror is not None else None
        self.rebuild(e + 1, ids)
        digest = self.reshard(old, held) if held is not None else self.sync_state(0)
        state = (f"the ZeRO-{self.cfg.zero} state re-sharded over {len(ids)} ranks" if held is not None
                 else f"the state from rank {ids[0]}")
        secs = time.time() - t0
        what = (f"{ranks(add)} joined (pid {','.join(str(pids.get(r, '?')) for r in add)}); ranks "
                f"{','.join(map(str, ids))} go on, world {len(old)} -> {len(ids)}, {state} (sha256 {digest[:12]}) "
                f"at step {step + 1}")
        if self.rt.is_main:
            members.record(self.out, {"epoch": e + 1, "step": step + 1, "members": ids, "lost": {}, "joined": add,
                                      "what": what, "pids": pids, "time": time.time(), "recover_s": secs})
            print(f"braidtrain: live: {what} ({secs:.1f} s)", flush=True)
        self.report = {"world_size": len(ids), "join_s": secs}

    def arrive(self, epoch: int, ids: list[int], add: list[int], step: int) -> None:
        """A joiner's side of grow(): it is a member from `step` on; its state comes from the others."""
        with self.lock:
            self.ids, self.replicas, self.epoch = ids, ids, epoch  # (a joiner: dp alone)
        self.guard.watch(ids)
        self.redivide()
        self.arriving = True
        if self.cfg.zero:
            digest, source = self.reshard([i for i in ids if i not in add], {}), "re-sharded from the members"
        else:
            digest, source = self.sync_state(0), f"from rank {ids[0]}"
        self.arriving = False
        print(f"braidtrain: rank {self.rt.rank}: joined at step {step + 1}, the state {source} "
              f"(sha256 {digest[:12]}, checked)", file=sys.stderr, flush=True)
