"""When something goes wrong: the heartbeat, the flight log, `braidtrain doctor`, and a test hook.

A hung collective is the worst way for a run to fail: the survivors wait, silently, until the
collective timeout (10-30 minutes by default), and nobody can say afterwards who stopped where.
So every rank runs a `Guard`:

  heartbeat  thread `beat` writes hb/<rank> = its clock into the run's store every interval and
             reads the values of the next few ranks (a ring: each rank is watched by up to
             WATCHERS others, so the store's load grows with N, not N^2). Thread `watch` judges:
             a peer whose value has not changed for `timeout` seconds *on my clock* (so clock skew
             between hosts does not matter), or a store that has not answered for as long (rank 0,
             or torchrun's agent, died or froze), is lost. The judge never touches the store itself
             -- a frozen store host can block a store call forever -- so detection takes at most
             timeout + interval whatever the store does. Both threads are independent of the main
             loop (a long checkpoint save or validation cannot starve them; they wait with the GIL
             released) and are daemons (they never keep a finished process alive).
  peer lost  the first rank to notice publishes hb/abort so that the others do not each wait out
             their own timeout, SIGKILLs the silent peer if it runs on its own host (a frozen
             process ignores torchrun's SIGTERM, which then waits ~30 s to kill it), writes its
             flight log, and leaves with os._exit(EXIT_PEER_LOST):
             the main thread is stuck in a collective and cannot be unwound. torchrun sees a failed
             worker and restarts the group, which resumes from the newest checkpoint.
  signals    SIGTERM (torchrun stopping the group, a scheduler's preemption) and SIGINT write the
             flight log and exit 128 + signal. Python runs signal handlers only in the main thread,
             between bytecodes -- never while it is blocked in a collective -- so the handler is a
             no-op whose only job is to make Python's C-level handler write the signal number to a
             wakeup pipe; the watch thread reads the pipe and acts.
  crashes    an exception in the training loop writes the flight log (main thread) and propagates.

The flight log is `<run>/flight/rank_NNNNN.jsonl`: a header line (rank, world size, step, attempt,
session, time, reason, the members of every group it used), then comm.py's ring buffer of
collective records, oldest first. `diagnose` (the `doctor` subcommand) lines the ranks' logs up
group by group, by each group's own sequence number: a tp group may have run a hundred
collectives for every one of the world group, and a pipeline stage's sends are its pair's alone.
A rank that was frozen (SIGSTOP) or killed (SIGKILL) cannot write anything: it is named by the
absence of its file and by the collective its group's other members were left waiting in.
"""

from __future__ import annotations

import errno
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from braidtrain.errors import UserError

EXIT_PEER_LOST = 75  # EX_TEMPFAIL: a temporary failure, worth a restart
WATCHERS = 8  # each rank watches the next WATCHERS ranks of the ring


def _noop(_signum, _frame):
    pass  # see "signals" above: the watch thread does the work


class Guard:
    """Heartbeat, signal handling and flight-log dumps for one rank (see the module docstring).
    `comm.step` tells the dumps which step the rank was in."""

    def __init__(self, rt, comm, flight_dir: Path, session: float, heartbeat_timeout: float):
        self.rt, self.comm, self.session = rt, comm, session
        self.path = Path(flight_dir) / f"rank_{rt.rank:05d}.jsonl"
        self.timeout = heartbeat_timeout
        world = rt.world_size
        self.heartbeat = heartbeat_timeout > 0 and world > 1
        # how often to beat and judge; signals wake the watch thread at once whatever it is
        self.interval = min(1.0, heartbeat_timeout / 5) if self.heartbeat else 1.0
        self.watched = [(rt.rank + i) % world for i in range(1, min(world, WATCHERS + 1))]
        self.lock = threading.RLock()  # one dump-and-exit at a time; the first failure wins
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.saved_signals = None
        self.clean = False
        self.live = None  # live recovery (live/): a lost peer is its to handle, while it can
        self.members: list[int] | None = None  # the ranks of the world now, when live recovery changed it

    # -- life cycle -------------------------------------------------------------------------------
    def start(self) -> None:
        now = time.monotonic()
        self.seen = {p: now for p in self.watched}  # when each peer's heartbeat last changed (my clock)
        self.done: set[int] = set()  # peers that finished cleanly
        self.store_ok = now  # when the store last answered
        self.abort = None  # a peer's verdict, read from hb/abort
        self.where: dict[int, tuple[str, int]] = {}  # watched peers' (host, pid), from hb/pid/<rank>
        self.wake_r = None
        if threading.current_thread() is threading.main_thread():
            self.wake_r, wake_w = os.pipe()
            os.set_blocking(wake_w, False)
            old_fd = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
            self.saved_signals = (old_fd, wake_w, {s: signal.signal(s, _noop) for s in (signal.SIGTERM, signal.SIGINT)})
        if self.heartbeat:  # where this rank runs, for a peer that finds it frozen (_end_frozen): now, at
            try:  # the start, from the main thread -- a rank may freeze before its first beat
                self.rt.connect(self.timeout).set(f"hb/pid/{self.rt.rank}", f"{socket.gethostname()}:{os.getpid()}")
            except Exception:
                pass
        targets = [self._watch] + ([self._beat] if self.heartbeat else [])
        self.threads = [threading.Thread(target=t, name=f"braidtrain-{t.__name__[1:]}", daemon=True) for t in targets]
        for t in self.threads:
            t.start()

    def close(self, clean: bool) -> None:
        """Stop both threads. `clean`: this rank is past its last collective, so its peers may stop
        watching it (hb/<rank> = "done"); after a failure it must look dead instead."""
        if self.stop.is_set():
            return
        self.clean = clean
        self.stop.set()
        for t in self.threads:
            t.join(timeout=2.0)  # the beat thread may be stuck on a dead store: it is a daemon
        if self.saved_signals is not None:
            old_fd, wake_w, handlers = self.saved_signals
            signal.set_wakeup_fd(old_fd)
            for s, h in handlers.items():
                signal.signal(s, h)
            os.close(wake_w)
            os.close(self.wake_r)
            self.saved_signals = None

    def watch(self, members: list[int]) -> None:
        """Watch these ranks from now on (live recovery changed the world): the ring over them."""
        ring = sorted(members)
        i = ring.index(self.rt.rank)
        watched = [ring[(i + k) % len(ring)] for k in range(1, min(len(ring), WATCHERS + 1))]
        now = time.monotonic()
        self.seen = {p: now for p in watched}
        self.watched, self.members = watched, list(members)

    # -- flight log -------------------------------------------------------------------------------
    def header(self, reason: str) -> dict:
        h = {"flight": 1, "rank": self.rt.rank, "world_size": self.rt.world_size, "step": self.comm.step,
             "attempt": self.rt.attempt, "session": self.session, "time": time.time(), "reason": reason,
             "next_seq": self.comm.seq, "pid": os.getpid()}
        return h if self.members is None else {**h, "members": self.members}

    def dump(self, reason: str, path: Path | None = None) -> Path:
        with self.lock:
            path = path or self.path
            self.comm.dump(str(path), self.header(reason))
            return path

    def fatal(self, reason: str, code: int) -> None:
        """Write the flight log, say why in one line, and leave now (the main thread may be stuck)."""
        with self.lock:
            try:
                where = f"flight log {self.dump(reason)}"
            except OSError as e:
                where = f"could not write the flight log: {e}"
            print(f"braidtrain: rank {self.rt.rank}: {reason}; {where}; exiting", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(code)

    # -- the two threads --------------------------------------------------------------------------
    def _beat(self) -> None:
        """Store I/O only; may block on a frozen store (the watch thread then sees store_ok age)."""
        present, last, client = set(), {}, None
        while not self.stop.wait(self.interval):
            try:
                if client is None:
                    client = self.rt.connect(self.timeout)
                client.set(f"hb/{self.rt.rank}", f"{time.time():.3f}")
                for p in [p for p in self.watched if p not in self.where and client.check([f"hb/pid/{p}"])]:
                    host, pid = client.get(f"hb/pid/{p}").decode().rsplit(":", 1)
                    self.where[p] = host, int(pid)
                present |= {p for p in self.watched if p not in present and client.check([f"hb/{p}"])}
                watched = [p for p in self.watched if p in present]
                now = time.monotonic()
                for p, v in zip(watched, client.multi_get([f"hb/{p}" for p in watched]) if watched else []):
                    if v == b"done":
                        self.done.add(p)
                    elif v != last.get(p):
                        last[p], self.seen[p] = v, now
                if client.check(["hb/abort"]):
                    self.abort = client.get("hb/abort").decode()
                if self.live is not None:
                    self.live.poll(client)
                self.store_ok = time.monotonic()
            except Exception:  # the store is gone or slow: reconnect next time; the judge counts
                client = None
        if self.clean and client is not None:
            try:
                client.set(f"hb/{self.rt.rank}", "done")
            except Exception:
                pass

    def _watch(self) -> None:
        woke = grace = time.monotonic()
        while not self.stop.is_set():
            if self.wake_r is None:  # not the main thread: no signal handling
                self.stop.wait(self.interval)
            elif select.select([self.wake_r], [], [], self.interval)[0]:
                for signum in os.read(self.wake_r, 64):
                    if signum in (signal.SIGTERM, signal.SIGINT):
                        name, cause = signal.Signals(signum).name, self._peer_lost()
                        self.fatal(f"peer lost: {cause} (then {name})" if cause else f"signal {name}", 128 + signum)
            now = time.monotonic()
            if now - woke > self.interval + self.timeout / 2:  # this process itself stood still (no CPU, or the
                grace = now + 2 * self.interval  # GIL held): its beat thread gets a turn before anyone is judged
            woke = now
            if self.heartbeat and not self.stop.is_set() and now >= grace:
                if self.abort:
                    self.fatal(f"peer lost: {self.abort}", EXIT_PEER_LOST)
                verdict = self._verdict()
                if verdict and self.live is not None and time.monotonic() - self.store_ok <= self.timeout \
                        and self.live.peer_lost(verdict):
                    continue  # live recovery handles it (the store, its means, still answers)
                if verdict:
                    self._publish(f"rank {self.rt.rank} saw: {verdict}")
                    self._end_frozen()
                    self.fatal(f"peer lost: {verdict}", EXIT_PEER_LOST)

    def _peer_lost(self) -> str | None:
        """On a signal: whether a peer was lost first -- torchrun terminates every rank as soon as
        one has left, often before the others' heartbeat saw the abort that rank published; the
        flight log should then give the cause, not the signal. Asks the store once (briefly)."""
        if not self.heartbeat:
            return None
        if not self.abort:
            try:
                client = self.rt.connect(min(self.timeout, 1.0))
                if client.check(["hb/abort"]):
                    self.abort = client.get("hb/abort").decode()
            except Exception:
                pass
        return self.abort or self._verdict()

    def _verdict(self) -> str | None:
        now = time.monotonic()
        if now - self.store_ok > self.timeout:
            return (f"the rendezvous store has not answered for {now - self.store_ok:.1f} s "
                    f"(its host, rank 0 or torchrun's agent, died or froze)")
        stale = [(p, now - t) for p, t in list(self.seen.items()) if p not in self.done and now - t > self.timeout]
        if stale:
            return "; ".join(f"rank {p} sent no heartbeat for {age:.1f} s (dead or frozen)" for p, age in stale)
        return None

    def _end_frozen(self) -> None:
        """SIGKILL the silent peers that run on this host: a frozen process ignores torchrun's
        SIGTERM, and its agent waits ~30 s before its own SIGKILL -- this way the group restarts
        within seconds of the verdict. (A peer on another host is that host's agent's to end.)"""
        now, host = time.monotonic(), socket.gethostname()
        for p, t in list(self.seen.items()):
            if p not in self.done and now - t > self.timeout and self.where.get(p, ("", 0))[0] == host:
                try:
                    os.kill(self.where[p][1], signal.SIGKILL)
                    print(f"braidtrain: rank {self.rt.rank}: ended rank {p} (pid {self.where[p][1]}), silent for "
                          f"{now - t:.1f} s", file=sys.stderr, flush=True)
                except OSError:
                    pass

    def _publish(self, msg: str) -> None:
        """hb/abort = msg, so that every rank dumps now. Best effort, from a throwaway thread with
        its own connection: the store may be the very thing that is gone."""
        def post():
            try:
                self.rt.connect(self.timeout).compare_set("hb/abort", "", msg)
            except Exception:
                pass
        t = threading.Thread(target=post, daemon=True)
        t.start()
        t.join(2.0)


def crash_reason(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    kind = "timeout" if "timed out" in text.lower() or "timeout" in text.lower() else "crash"
    return f"{kind}: {type(e).__name__}: {text}"[:500]


# ------------------------------------------------------------------------------------ test hook

FAULT_KINDS = {
    "kill": "SIGKILL this rank in the middle of the step (after its first micro-batch's forward)",
    "stop": "SIGSTOP (freeze) this rank at the same point",
    "kill-late": "SIGKILL this rank after it applied the step's update, before the step's loss is summed (--live-recovery)",
    "fail-update": "fail this rank's wait as if a peer were lost just before it applies the step's update: a survivor "
                   "left one update behind (--live-recovery)",
    "save": "fail the checkpoint save of that step after this rank's file is written (ENOSPC)",
    "slow-save": "sleep `seconds` in the middle of that step's checkpoint save",
    "nan": "make this rank's loss of that step NaN (a last pipeline stage's rank)",
    "nan-on": "make this rank's loss NaN from that step on",
    "oom": "raise torch's out-of-memory error in the middle of that step",
    "local-disk": "at the first checkpoint save, leave this rank's marker in a folder of its own (a node-local disk)",
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
    def from_env(rank: int, attempt: int) -> "Fault | None":
        spec = os.environ.get("BRAIDTRAIN_FAULT")
        if not spec:
            return None
        fault = Fault(spec)  # parsed on every rank and attempt: a typo is an error everywhere
        return fault if attempt == 0 and fault.rank in (None, rank) else None

    def _announce(self, what: str) -> None:
        print(f"braidtrain: fault injected: {what} at step {self.step} (t={time.time():.3f})", file=sys.stderr, flush=True)

    def mid_step(self, step: int) -> None:
        if step == self.step and self.kind == "oom":
            import torch

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

    def mid_save(self, step: int) -> None:
        if step == self.step and self.kind == "save":
            self._announce("checkpoint save fails")
            raise OSError(errno.ENOSPC, f"No space left on device (injected by BRAIDTRAIN_FAULT, step {step})")
        if step == self.step and self.kind == "slow-save":
            self._announce(f"checkpoint save sleeps {self.seconds:g} s")
            time.sleep(self.seconds)


# ------------------------------------------------------------------------------------ doctor

def read_logs(flight_dir: Path) -> tuple[dict[int, dict], dict[int, list[dict]], list[str]]:
    """(headers, records, problems) of the latest session's logs; older sessions' files are ignored
    (their rank counts as silent), unreadable ones are reported."""
    logs, problems = {}, []
    for f in sorted(flight_dir.glob("rank_*.jsonl")):
        try:
            lines = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
            if not lines or lines[0].get("flight") != 1:
                raise ValueError("no header line")
            logs[f] = lines
        except (ValueError, OSError) as e:
            problems.append(f"{f.name} is unreadable ({e}); its rank counts as silent")
    if not logs:
        raise UserError(f"no flight logs in {flight_dir}: a rank writes one when it fails, is signalled, or loses a peer")
    latest = max(l[0]["session"] for l in logs.values())
    headers, records = {}, {}
    for f, lines in logs.items():
        h = lines[0]
        if h["session"] != latest:
            problems.append(f"{f.name} is from an earlier session ({_when(h['session'])}); ignored")
            continue
        headers[h["rank"]], records[h["rank"]] = h, lines[1:]
    return headers, records, problems


def _when(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _ranks(rs) -> str:
    rs = sorted(rs)
    return f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}"


def _desc(r: dict) -> str:
    """'all_reduce tp[0,1], step 3' -- with a pipeline transfer's tensor: 'p2p pp[1>0], step 3,
    recv grad chunk 0 micro 2' (the direction's group names the sender first)."""
    return f"{r['op']} {r['group']}, step {r['step']}" + (f", {r['what']}" if r.get("what") else "")


MEMBERSHIP = "membership.jsonl"  # in RUN/flight: each change of the world that live recovery made (live/)


def diagnose(run: Path) -> list[str]:
    """What the flight logs of a run say, as lines of text: who stopped where, or who disagreed --
    after the membership changes that live recovery made, each with what its survivors' logs say
    (RUN/flight/live-EPOCH/), when there are any."""
    flight = Path(run) / "flight"
    if not flight.is_dir():
        raise UserError(f"{run}: no flight/ folder (no rank of this run has failed, been signalled or lost a peer)")
    out = []
    if (flight / MEMBERSHIP).is_file():
        for line in (flight / MEMBERSHIP).read_text().splitlines():
            if line.strip():
                c = json.loads(line)
                out.append(f"membership change {c['epoch']} at step {c['step']}: {c['what']}")
                folder = flight / f"live-{c['epoch'] - 1}"
                if folder.is_dir() and any(folder.glob("rank_*.jsonl")):
                    out += [f"  {l}" for l in _diagnose_logs(folder)]
    if out and not any(flight.glob("rank_*.jsonl")):
        return out
    return out + _diagnose_logs(flight)


def _diagnose_logs(flight: Path) -> list[str]:
    headers, records, out = read_logs(flight)
    any_h = next(iter(headers.values()))
    world = any_h["world_size"]
    silent = [r for r in any_h.get("members", range(world)) if r not in headers]
    out.insert(0, f"flight logs of {_when(any_h['session'])} (attempt {any_h['attempt']}, world size {world}): "
                  f"{len(headers)} written" + (f", none from {_ranks(silent)}" if silent else ""))
    by_reason: dict[str, list[int]] = {}
    for r, h in headers.items():
        by_reason.setdefault(h["reason"], []).append(r)
    out += [f"  {_ranks(rs)}: {reason} (step {headers[rs[0]]['step']})" for reason, rs in sorted(by_reason.items())]

    members = {}  # group name -> its ranks (a log without the table: the group is every rank)
    for h in headers.values():
        members.update(h.get("groups", {}))
    for recs in records.values():  # logs written before records named their group: one numbering
        for x in recs:
            x.setdefault("group", x.get("axis", "world"))
            x.setdefault("gseq", x["seq"])
    by = {r: {} for r in records}  # rank -> group -> gseq -> record
    for r, recs in records.items():
        for x in recs:
            by[r].setdefault(x["group"], {})[x["gseq"]] = x
    # 1. The same number in a group must be the same collective on each of its members.
    for g in sorted({g for r in by for g in by[r]}):
        logs = {r: by[r][g] for r in by if g in by[r]}
        common = set.intersection(*(set(v) for v in logs.values())) if len(logs) > 1 else set()
        for k in sorted(common):
            sig: dict[tuple, list[int]] = {}
            for r, v in logs.items():
                sig.setdefault((v[k]["op"], tuple(v[k]["shape"]), v[k]["dtype"]), []).append(r)
            if len(sig) > 1:
                what = "; ".join(f"{_ranks(rs)} issued {op} {g} {dtype}{list(shape)}" for (op, shape, dtype), rs in sig.items())
                return out + [f"mismatch at collective #{k} (step {logs[min(logs)][k]['step']}): {what}"]
    # 2. Who was left waiting where, and which member of that group never came.
    waiting = {}
    for r, recs in records.items():
        open_ = [x for x in recs if x["t_end"] is None]
        # a pipeline send is left to complete (nobody waits on it, so gloo's stays open): a rank
        # waits in its oldest open operation that blocks -- a receive, or a collective
        blocking = [x for x in open_ if not x.get("what", "").startswith("send")] or open_
        if blocking:
            waiting[r] = min(blocking, key=lambda x: x["seq"])
    if not waiting:
        if silent:
            done = [x for recs in records.values() for x in recs if x["t_end"] is not None]
            last = max(done, key=lambda x: x["t_end"], default=None)
            return out + [f"{_ranks(silent)} wrote no flight log; the others were not inside a collective"
                          + (f" (last completed: #{last['gseq']} ({_desc(last)}))" if last else "")]
        return out + ["no problem found: every rank's last collective completed"]
    points: dict[tuple, list[int]] = {}  # (group, gseq) -> the ranks waiting there
    for r, x in waiting.items():
        points.setdefault((x["group"], x["gseq"]), []).append(r)
    culprits, tails, named, stuck_elsewhere = [], [], set(), False
    for (g, k), waiters in sorted(points.items(), key=lambda p: min(waiting[r]["t_start"] for r in p[1])):
        for m in members.get(g, range(world)):
            if m in waiters or m in named:
                continue
            if m in waiting:  # waits elsewhere: named where it waits; it holds this group up if it never came
                stuck_elsewhere |= max(by[m].get(g, {}), default=-1) < k
                continue
            if m in silent:
                done = [x for r in by for x in by[r].get(g, {}).values() if x["t_end"] is not None]
                prev = max(done, key=lambda x: x["gseq"], default=None)
                culprits.append(f"rank {m} stopped after collective #{prev['gseq'] if prev else -1}"
                                + (f" ({_desc(prev)})" if prev else "") + " and wrote no flight log (frozen or killed)")
            else:
                issued = by[m].get(g, {})
                j = max(issued, default=-1)
                if j >= k:
                    continue
                culprits.append(f"rank {m} stopped at collective #{j}" + (f" ({_desc(issued[j])})" if issued else ""))
            named.add(m)
        tails.append(f"{_ranks(waiters)} waited in #{k} ({_desc(waiting[waiters[0]])})")
    if not culprits and stuck_elsewhere:  # each waits for one who waits elsewhere
        return out + ["; ".join(tails) + ": each waits for a rank that waits elsewhere -- the ranks issued "
                      "their collectives in orders that cannot meet (a deadlock)"]
    if not culprits:  # everyone issued what they wait in, and it did not complete: the transport, not a rank
        what = ", and ".join(f"#{k} ({_desc(waiting[ws[0]])}) on {_ranks(ws)}" for (_, k), ws in points.items())
        return out + [f"every rank issued collective {what}, but it did not complete: look at the network / NCCL "
                      f"rather than at one rank"]
    return out + ["; ".join(culprits + tails)]
