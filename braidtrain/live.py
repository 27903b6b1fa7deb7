"""Live recovery: a lost data-parallel rank costs no restart and no step (--live-recovery).

Without it, any failure ends every process and the job restarts from the last checkpoint
(fault.py, docs/fault-tolerance.md). With it, under data parallelism alone and ZeRO-0 -- every rank
holds the whole model and optimizer state -- the survivors carry on in the same processes:

    rank 2 killed ──► a survivor's collective fails (gloo: the connection closed) ──┐
    rank 1 frozen ──► a survivor's heartbeat finds it silent for --heartbeat-timeout ─┤
                                                                                     ▼
    it sets live/E/abort in the rendezvous store; every member's heartbeat thread reads it and
    sets comm.abort, and each rank's wait in a collective gives up (comm.Aborted)
    each survivor writes its flight log (RUN/flight/live-E/), says it is here (live/E/here/RANK)
    and waits; the first to see every member here or lost -- its process gone from this host, or
    its heartbeat silent for the timeout -- writes the new membership (live/E/next, first writer wins)
    survivors: a new process group on the same store (prefix live/E+1/pg), the mesh over them,
    the lost ranks' sequences of the step divided among them; the step is done again, whole

Ranks keep their number (the heartbeat's keys, the checkpoint's file names, the flight logs' names);
the process group numbers the members 0..n-1 in rank order. The store lives in rank 0's process
(-pi tcp / -pi fs), so rank 0 is the one rank whose loss cannot be recovered live: the survivors
find the store gone and fall back to the restart path (exit 75), as they do when the main thread is
stuck where it cannot be interrupted (a checkpoint save's barrier) or no agreement comes in time.

Slots. The run starts with D data ranks (a power of two in exact mode), each reading its slot of m
micro-batches of every step: global micro-batch g = slot * m + j is sequences g*b .. g*b+b-1 of the
step (data.py: a pure function of (step, sequence)). After a loss, each survivor keeps its own
slot and takes a contiguous share of the orphaned slots' micro-batches. The step's loss and, in
exact mode, its gradient are summed by global micro-batch number, along the one tree that the
uninterrupted run used (parallel/exact.py): each rank sums what it can of the tree locally
(LiveTree: the complete subtrees of the micro-batches it ran), the pieces cross ranks by one
all-to-all (each rank receives its slice of every piece), each rank folds its slice along the tree
and an all-gather rebuilds the whole gradient. So in --exact the final weights equal, bit for bit,
those of a run that never lost a rank. Without --exact the gradient is all-reduced as usual: the
same data and -d, other rounding.

A step interrupted after some survivors applied its update (a loss inside the step's last
collective) is not done twice: the survivors report how far they got, and those behind take the
state of one ahead, broadcast and checked by sha256 (sync_state).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from braidtrain.dist.flight import Aborted
from braidtrain.errors import UserError
from braidtrain.dist.fault import EXIT_PEER_LOST, MEMBERSHIP
from braidtrain.join import build_joiner
from braidtrain.dist.mesh import build_mesh
from braidtrain.parallel import schedule
from braidtrain.parallel.buckets import Q
from braidtrain.parallel.exact import TreeSum
from braidtrain.parallel.slots import LiveTree, forest, reduce_forests, shares, sum_by_number
from braidtrain.train import Trainer

TRANSPORT = ("connection closed", "connection reset", "broken pipe", "timed out", "gloo", "socket")
_leaked = []  # the process groups given up: never destroyed (their threads may wait on a dead peer)


def check_config(cfg) -> None:
    """--live-recovery's one-line refusals, before anything starts; ZeRO 1-3 go back to the
    restart path with a note."""
    if cfg.join and not cfg.live_recovery:
        raise UserError("--join adds a process to a job that runs with --live-recovery: give both")
    others = [f"--{a} {getattr(cfg, a)}" for a in ("pp", "cp", "tp", "ep") if getattr(cfg, a) != 1]
    if others:
        raise UserError(f"--live-recovery needs data parallelism alone, got {' '.join(others)}: losing one of "
                        f"those ranks takes its whole replica out, which live recovery does not do; drop "
                        f"--live-recovery (the checkpoint restart recovers these layouts)")
    if cfg.heartbeat_timeout <= 0:
        raise UserError("--live-recovery finds frozen ranks by the heartbeat: give --heartbeat-timeout > 0")
    if cfg.device not in (None, "cpu") or (cfg.device is None and torch.cuda.is_available()):
        raise UserError("--live-recovery runs on CPU (gloo) only: NCCL's communicators would have to be aborted, "
                        "which is not built; drop --live-recovery (or use --device cpu)")
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("WORLD_SIZE", "1") != "1":
        raise UserError("--live-recovery under torchrun: its agents stop (and restart) every worker when one fails; "
                        "start one process per rank with -pi tcp or -pi fs instead (scripts/live.sh)")
    if cfg.join and (cfg.init_method != "tcp" or not cfg.process_rank):
        raise UserError("--join replaces a lost rank of a running job: give -pi tcp -ps ADDRESS (the job's), its -pn and "
                        "the lost rank's -pr (not 0: rank 0 hosts the store)")
    if cfg.zero:
        if cfg.join:
            raise UserError(f"--join needs the job's state whole on a peer: ZeRO-0, not ZeRO-{cfg.zero}")
        if os.environ.get("RANK", "0") == "0" and cfg.process_rank in (None, 0):
            print(f"braidtrain: note: --live-recovery keeps ZeRO-0's state only (every rank holds all of it); with "
                  f"ZeRO-{cfg.zero} a lost rank's shard is gone, so a loss falls back to the checkpoint restart",
                  file=sys.stderr, flush=True)
        cfg.live_recovery = False


class _Done:
    def wait(self):
        pass


def _first_line(e: BaseException) -> str:
    """The error's first line, without gloo's source location and advice."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = re.sub(r"^\[[^\]]*\] ", "", text).split(". This is typically")[0]
    return text[:300]


def _is_transport(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, (Aborted, dist.DistError)) or (isinstance(e, RuntimeError) and any(w in text for w in TRANSPORT))


def _gone(pid: int) -> bool:
    """This host's process pid has exited (or is a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True
        except OSError:
            return False


class LiveTrainer(Trainer):
    """The training loop with live recovery (module docstring). Ranks keep their numbers; `ids`
    are the members now, in process-group order."""

    def __init__(self, cfg):
        super().__init__(cfg, build_joiner(cfg) if cfg.join else None)
        self.on = cfg.live_recovery and (self.rt.world_size > 1 or cfg.join)
        self.ids = list(range(self.layout.dp))
        self.D, self.m, self.b = self.layout.dp, self.batch.micro_steps, self.cfg.batch_size
        self.M = self.D * self.m  # micro-batches of a step
        self.plan = {i: list(range(i * self.m, (i + 1) * self.m)) for i in self.ids}  # id -> its global micro-batches
        self.epoch, self.degraded, self.recovering, self.noticed = 0, False, False, None
        self.lock = threading.Lock()
        self.applied = False  # this step's update was applied on this rank
        self.arriving = False  # a joiner, taking its state
        self.report = None  # the first step after a change: what to say when it is done
        if self.on:
            self.comm.abort = threading.Event()
            self.guard.live = self
            update = self.opt.update

            def tracked(*a, **k):
                update(*a, **k)
                self.applied = True
                if self.fault and self.fault.kind == "kill-late" and self.comm.step == self.fault.step:
                    self.fault._announce(f"SIGKILL pid {os.getpid()} after the update")
                    os.kill(os.getpid(), signal.SIGKILL)

            self.opt.update = tracked
        self.joined: dict = {}  # ranks admitted at the next change, and at which step
        if self.on and self.rt.is_main:
            self.rt.store.set("live/config", self.cfg.to_toml())  # what a joiner checks its flags against
        if cfg.join:
            adm = self.built.admission
            self.arrive(adm["epoch"], adm["members"], adm["step"])

    # -- the watch threads' side (fault.Guard) ---------------------------------------------------
    def peer_lost(self, verdict: str) -> bool:
        """The heartbeat judged a peer lost: abort this rank's waits, and let the main thread
        recover -- unless it does not come within the grace (stuck where it cannot be interrupted):
        then False, and the guard falls back to the restart path."""
        if self.recovering:
            return True
        now = time.monotonic()
        if self.noticed is None:
            self.noticed, self.cause = now, verdict
            self.comm.abort.set()
        return now - self.noticed < 2 * self.cfg.heartbeat_timeout

    def poll(self, client) -> None:
        """(The heartbeat thread, every beat.) Another member began a recovery: abort our waits too."""
        e = self.epoch
        late = self.noticed is not None and time.monotonic() - self.noticed > 2 * self.cfg.heartbeat_timeout
        if late and not self.recovering:
            self.fall_back("this rank did not get back from where it waited (not a collective it can abandon)")
        if not self.comm.abort.is_set() and client.check([f"live/{e}/abort"]):
            cause = client.get(f"live/{e}/abort").decode()
            with self.lock:
                if e == self.epoch and not self.comm.abort.is_set():
                    self.cause, self.noticed = cause, self.noticed or time.monotonic()
                    self.comm.abort.set()

    # -- the step --------------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        if self.on and len(self.ids) < self.D:
            self.boundary(step)
        while True:
            count, self.applied = self.opt.step_count, False
            try:
                rec = super().step(step)
                break
            except Exception as e:
                if not self.on or not _is_transport(e):
                    raise
                if not self.applied:
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

    def _run(self) -> dict:
        try:
            summary = super()._run()
            if self.on and self.rt.is_main:  # a joiner still waiting will not be admitted now
                for r in range(1, self.D):
                    if self.rt.store.check([f"live/join/{r}"]):
                        self.rt.store.set(f"live/joined/{r}", json.dumps({"refused": f"the run ended at step "
                                                                                     f"{self.cfg.max_steps}"}))
            return summary
        except Exception as e:  # outside a step (a checkpoint save, validation): no live recovery there
            if self.on and _is_transport(e):
                self.fall_back(f"a peer was lost outside a training step ({_first_line(e)})")
            raise

    def check_shared(self, ckpt_dir) -> None:
        if not self.degraded:  # (after a change, the ranks' markers are not 0..n-1)
            super().check_shared(ckpt_dir)

    def recover(self, step: int, err: BaseException) -> int:
        """Agree on the survivors, rebuild the world over them, bring them to one state; returns
        the number of steps that state has done (step: redo it; step + 1: it was done)."""
        t0, me, e = time.time(), self.rt.rank, self.epoch
        self.recovering = True
        cause = f"rank {me}: {_first_line(err)}" if not isinstance(err, Aborted) else getattr(self, "cause", "")
        store = self.rt.store
        try:
            store.compare_set(f"live/{e}/abort", "", cause)  # wake the members still waiting
            self.guard.dump(f"live recovery: {cause}", self.out / "flight" / f"live-{e}" / f"rank_{me:05d}.jsonl")
            done = step + 1 if self.applied else step
            store.set(f"live/{e}/here/{me}", json.dumps({"done": done, "pid": os.getpid()}))
            decision = self.agree(e)
        except Exception as x:  # the store is gone with rank 0, or never agreed
            self.fall_back(f"live recovery failed ({_first_line(x)})")
        ids, lost = decision["members"], {int(k): v for k, v in decision["lost"].items()}
        if me not in ids:
            print(f"braidtrain: rank {me}: the others went on without this rank (judged lost); exiting",
                  file=sys.stderr, flush=True)
            os._exit(EXIT_PEER_LOST)
        if not lost:  # everyone is here: the error was not a lost peer
            raise err
        self.rebuild(e + 1, ids)
        done = decision["done"]
        target = max(done.values())
        if min(done.values()) != target:  # some applied the step's update: the others take their state
            self.sync_state(ids.index(min(int(i) for i, d in done.items() if d == target)))
        secs = time.time() - t0
        what = (f"rank{'s' if len(lost) > 1 else ''} {','.join(map(str, sorted(lost)))} lost "
                f"({'; '.join(lost.values())}); ranks {','.join(map(str, ids))} go on, world "
                f"{len(ids) + len(lost)} -> {len(ids)}, "
                + (f"step {step + 1} done again" if target == step else f"step {step + 1} already applied"))
        if self.rt.is_main:
            change = {"epoch": e + 1, "step": step + 1, "members": ids, "lost": lost, "what": what,
                      "pids": decision["pids"], "cause": cause, "time": time.time(), "recover_s": secs}
            self.record(change)
            print(f"braidtrain: live recovery at step {step + 1}: {what} ({secs:.1f} s)", flush=True)
        self.report = {"world_size": len(ids), "recover_s": secs}
        return target

    def agree(self, e: int) -> dict:
        """The next membership: once every member is here (live/E/here/RANK) or lost, the first
        to see it writes it (compare_set: one decision, read by all)."""
        store, key = self.rt.store, f"live/{e}/next"
        deadline, since = time.monotonic() + self.cfg.timeout, {}
        while time.monotonic() < deadline:
            if store.check([key]):
                decision = json.loads(store.get(key))
                for p in decision["lost"]:  # (after the decision: its reasons are the ones seen before)
                    self.end(int(p))
                return decision
            here = {p: json.loads(store.get(f"live/{e}/here/{p}")) for p in self.ids
                    if store.check([f"live/{e}/here/{p}"])}
            lost = {p: why for p in self.ids if p not in here and (why := self.lost(p, since))}
            if len(here) + len(lost) == len(self.ids):
                decision = {"members": [p for p in self.ids if p in here], "lost": lost,
                            "done": {p: h["done"] for p, h in here.items()},
                            "pids": {p: h["pid"] for p, h in here.items()}}
                store.compare_set(key, "", json.dumps(decision))
                continue
            time.sleep(0.05)
        raise TimeoutError(f"no agreement on the members within {self.cfg.timeout:g} s")

    def lost(self, p: int, since: dict) -> str | None:
        """Why member p counts as lost, or None: its process gone from this host, or its heartbeat
        silent for the timeout (seen by this rank's guard, else since this recovery began)."""
        where = self.guard.where.get(p)
        if where and where[0] == socket.gethostname() and _gone(where[1]):
            return f"its process, pid {where[1]}, exited"
        now = time.monotonic()
        last = self.guard.seen.get(p, since.setdefault(p, now))
        if now - last > self.cfg.heartbeat_timeout:
            return f"no heartbeat for {now - last:.1f} s: frozen or dead"
        return None

    def end(self, p: int) -> None:
        """SIGKILL a lost member that runs on this host (a frozen one would wake into a world
        that went on without it)."""
        where = self.guard.where.get(p)
        if where and where[0] == socket.gethostname() and not _gone(where[1]):
            try:
                os.kill(where[1], signal.SIGKILL)
            except OSError:
                pass

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
        the world rebuilt over all, and the state sent from process-group rank 0, checked by sha256."""
        t0, e, add, store = time.time(), self.epoch, self.joined["add"], self.rt.store
        ids = sorted(self.ids + add)
        pids = {}
        if self.rt.is_main:
            for r in add:
                pids[r] = int(store.get(f"live/join/{r}"))
                store.set(f"live/joined/{r}", json.dumps({
                    "epoch": e + 1, "members": ids, "step": step, "out": str(self.out), "session": self.guard.session,
                    "run_id": self.built.run_id, "max_steps": self.cfg.max_steps}))
                store.delete_key(f"live/join/{r}")
        for r in add:
            self.guard.where.pop(r, None)  # (the lost process's host:pid; the joiner posts its own)
        self.rebuild(e + 1, ids)
        digest = self.sync_state(0)
        secs = time.time() - t0
        what = (f"rank{'s' if len(add) > 1 else ''} {','.join(map(str, add))} joined (pid "
                f"{','.join(str(pids.get(r, '?')) for r in add)}); ranks {','.join(map(str, ids))} go on, world "
                f"{len(ids) - len(add)} -> {len(ids)}, the state from rank {ids[0]} (sha256 {digest[:12]}) "
                f"at step {step + 1}")
        if self.rt.is_main:
            self.record({"epoch": e + 1, "step": step + 1, "members": ids, "lost": {}, "joined": add, "what": what,
                         "pids": pids, "time": time.time(), "recover_s": secs})
            print(f"braidtrain: live: {what} ({secs:.1f} s)", flush=True)
        self.report = {"world_size": len(ids), "join_s": secs}

    def arrive(self, epoch: int, ids: list[int], step: int) -> None:
        """A joiner's side of grow(): it is a member from `step` on; its state is rank ids[0]'s."""
        with self.lock:
            self.ids, self.epoch = ids, epoch
        self.guard.watch(ids)
        self.redivide()
        self.arriving = True
        digest = self.sync_state(0)
        self.arriving = False
        print(f"braidtrain: rank {self.rt.rank}: joined at step {step + 1}, the state from rank {ids[0]} "
              f"(sha256 {digest[:12]}, checked)", file=sys.stderr, flush=True)

    def record(self, change: dict) -> None:
        """One membership change, appended to RUN/flight/membership.jsonl (doctor reads it)."""
        (self.out / "flight").mkdir(parents=True, exist_ok=True)
        with open(self.out / "flight" / MEMBERSHIP, "a") as f:
            f.write(json.dumps(change) + "\n")

    # -- the new world ---------------------------------------------------------------------------
    def rebuild(self, epoch: int, ids: list[int]) -> None:
        """The process group, mesh and engine's groups over `ids`, and the step's work divided
        among them; what the abandoned step left behind is dropped."""
        rt, me, n = self.rt, self.rt.rank, len(ids)
        old = dist.group.WORLD
        _leaked.append(old)  # its worker threads may still wait on the lost peer: never destroy it
        dist.destroy_process_group()
        dist.init_process_group(rt.backend, store=dist.PrefixStore(f"live/{epoch}/pg", rt.store), rank=ids.index(me),
                                world_size=n, timeout=timedelta(seconds=self.cfg.timeout))
        comm = self.comm
        comm.records.clear(), comm.gseq.clear(), comm.members.clear()  # (the old world's are in its flight logs)
        comm.step_handles = []
        mesh = build_mesh(me, n, comm, new_group=rt.new_group, members=ids)
        self.mesh = self.built.mesh = self.passes.mesh = mesh
        e = self.engine
        e.tp, e.pp, e.world, e.ep = (mesh.groups[a] for a in ("tp", "pp", "world", "ep"))
        for b in e.buckets:
            b.group = mesh.groups[b.group.axis]
            b.shard_size = -(-b.padded // (n * Q)) * Q  # (ZeRO-0: the checkpoint's pieces of each rank)
            b.lo, b.hi = min(b.padded, ids.index(me) * b.shard_size), min(b.padded, (ids.index(me) + 1) * b.shard_size)
            b.handle, b.grad = None, None if e.exact else torch.zeros(b.padded, device=e.device)
        e.pending, e._pool = [], {}  # buffers the old group's threads may still write into are not reused
        e.tied.handle = e.tied.head_sum = e.tied.head_out = None
        rt.world_size = n
        self.layout = self.built.layout = dataclasses.replace(self.layout, dp=n)
        with self.lock:
            self.ids, self.epoch, self.joined = ids, epoch, {}
            self.comm.abort.clear()
            self.noticed, self.recovering = None, False
        self.guard.watch(ids)
        self.redivide()

    def redivide(self) -> None:
        """The step's work over the members now: each slot its own rank's, as the job began -- then
        the engine's own paths -- or, with slots missing, divided (divide)."""
        if self.ids != list(range(self.D)):
            self.divide()
            return
        if not self.degraded:
            return
        p, e = self.passes, self.engine
        self.degraded = False
        self.plan = {i: list(range(i * self.m, (i + 1) * self.m)) for i in self.ids}
        self.tokens = torch.zeros((2, self.batch.seqs_per_rank, self.cfg.seq_len), dtype=torch.long, device=self.device)
        p.tokens, self.next_tokens = self.tokens, (None, None)
        p.__dict__.pop("train_step", None), p.__dict__.pop("validate", None)
        if e.exact:
            e.trees = {b: TreeSum(e.recycle) for b in e.buckets}
            if e.tied.head is not None:
                e.tied.head = TreeSum(e.recycle)
            e.__dict__.pop("exact_reduce", None)

    def divide(self) -> None:
        """Each member keeps its slot's micro-batches and takes a contiguous share of the slots
        nobody holds now; the engine, the passes and the loss then work by global number."""
        self.plan = shares(self.ids, self.D, self.m)
        self.keys = {i: forest(g) for i, g in self.plan.items()}
        mine = self.plan[self.rt.rank]
        self.degraded = True
        self.tokens = torch.zeros((2, len(mine) * self.b, self.cfg.seq_len), dtype=torch.long, device=self.device)
        self.passes.tokens, self.next_tokens = self.tokens, (None, None)
        actions = schedule.build("sequential", len(mine))[0]
        self.passes.train_step = lambda: self.passes.executor.run(actions, len(mine))
        self.passes.validate = self.validate
        e = self.engine
        if e.exact:
            self.pending = {}
            e.trees = {b: LiveTree(e, mine, self.pending) for b in e.buckets}
            if e.tied.head is not None:
                e.tied.head = LiveTree(e, mine, self.pending)
            e.exact_reduce = self.exact_reduce

    def host_tokens(self, step: int) -> torch.Tensor:
        if not self.degraded:
            return super().host_tokens(step)
        xs, ys = zip(*(self.built.loader.batch(step, g * self.b, self.b) for g in self.plan[self.rt.rank]))
        return torch.stack((torch.cat(xs), torch.cat(ys)))

    def by_number(self, values: list[torch.Tensor], plan: dict, total: int) -> float:
        return sum_by_number(self.comm, self.mesh.groups["world"], self.ids, values, plan, total)

    def reduce_loss(self, losses: list[torch.Tensor]) -> float:
        if not self.degraded:
            return super().reduce_loss(losses)
        return self.by_number(losses, self.plan, self.M)

    def exact_reduce(self, b, grad, out, full, scratch):
        """Exact mode's reduction after a change (in place of Engine.exact_reduce): the members'
        subtrees of `grad`'s bucket summed along the step's one tree (slots.reduce_forests)."""
        nodes = self.pending.pop(id(grad))
        reduce_forests(self.comm, self.mesh.groups["world"], self.ids, self.keys, self.rt.rank, nodes, self.M, out)
        for t in nodes.values():
            self.engine.recycle(t)
        return _Done()

    @torch.no_grad()
    def validate(self, device) -> float:
        """Passes.validate after a change: the validation micro-batches divided among the members
        in contiguous shares, their losses summed by global number (the same bits)."""
        p, cfg, b = self.passes, self.cfg, self.b
        total = cfg.val_steps * self.batch.seqs_per_step
        micros, n = total // b, len(self.ids)
        cuts = [k * (micros // n) + min(k, micros % n) for k in range(n + 1)]
        plan = {i: list(range(cuts[k], cuts[k + 1])) for k, i in enumerate(self.ids)}
        mine = plan[self.rt.rank]
        sums = []
        if mine:
            xy = torch.stack(self.built.val_loader.val_batch(mine[0] * b, len(mine) * b)).to(device)

            def forward(stage, micro, inp):
                part = p.stage[stage]
                x, y = p.micro_batch(xy, micro)
                with p.autocast():
                    return part(x, y).float()

            for part in p.parts:
                part.eval()
            sums = p.executor_of(forward).run(p.forward_only(len(mine)), len(mine), train=False)
            for part in p.parts:
                part.train()
        return self.by_number(sums, plan, micros) / (total * cfg.seq_len)

    # -- state from a peer -----------------------------------------------------------------------
    def state(self) -> list[torch.Tensor]:
        """Everything a ZeRO-0 rank holds that a step changes: the weights and Adam's moments."""
        return [b.data for b in self.engine.buckets] + [t for m, v, _ in self.opt.groups for t in (m, v)]

    def digest(self) -> str:
        h = hashlib.sha256(str(self.opt.step_count).encode())
        for t in self.state():
            h.update(t.detach().cpu().numpy().tobytes())
        return h.hexdigest()

    def sync_state(self, src: int) -> str:
        """Every member takes the state of process-group rank `src` (broadcast), checked against
        its sha256: one line and the restart path if a copy differs."""
        world = self.mesh.groups["world"]
        for t in self.state():
            self.comm.broadcast(t, world, src).wait()
        box = [(self.opt.step_count, self.digest())]
        self.comm._sync("broadcast_object", world, lambda: dist.broadcast_object_list(box, src=src))  # (src: a
        step_count, want = box[0]  # process-group rank; the mesh's groups name ranks by their own numbers)
        self.opt.step_count = step_count
        got = self.digest()
        if got != want:
            why = f"the state received from rank {self.ids[src]} has sha256 {got[:12]}, not its {want[:12]}"
            if self.arriving:  # a joiner that got a bad copy leaves: the others lose it like any rank
                self.guard.fatal(f"joining: {why}", EXIT_PEER_LOST)
            self.fall_back(why)
        return got
