"""When something goes wrong: the heartbeat, the signals, the flight log written on a failure.

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
  signals    SIGTERM (torchrun stopping the group, a scheduler's preemption) and SIGINT ask the run
             to stop: the watch thread notes the first (Guard.signalled), the training loop reads
             every rank's note at each step boundary (one small all-reduce, train.py's stop_asked),
             so every rank finishes the same step, saves it and exits 128 + signal. The note also
             starts the clock: a run still alive --preempt-budget seconds after the signal writes its
             flight log and exits at once, as does a second signal (one within DUPLICATE_S of the
             first is the same request delivered twice: Slurm signals torchrun and its workers, and
             torchrun forwards its own). A signal after a peer was lost exits at once, naming the
             peer. Python runs signal handlers only in the main thread, between bytecodes -- never
             while it is blocked in a collective -- so the handler is a no-op whose only job is to
             make Python's C-level handler write the signal number to a wakeup pipe; the watch
             thread reads the pipe and acts.
  crashes    an exception in the training loop writes the flight log (main thread) and propagates;
             its reason names the lost peer where one was lost first (Guard.failure).

Each rank's flight log, and `braidtrain doctor`, which reads them: collective/doctor.py. The test hook
that makes a rank fail on purpose (BRAIDTRAIN_FAULT): collective/inject.py.
"""

from __future__ import annotations

import math
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path


EXIT_PEER_LOST = 75  # EX_TEMPFAIL: a temporary failure, worth a restart
WATCHERS = 8  # each rank watches the next WATCHERS ranks of the ring
MEMBERSHIP = "membership.jsonl"  # in RUN/flight: each change of the world that live recovery made (live/)
DUPLICATE_S = 1.0  # a repeat of the stop signal within this many seconds is the same request, not a second one


def _noop(_signum, _frame):
    pass  # see "signals" above: the watch thread does the work


def say(line: str) -> None:
    """One line to stderr in one write: ranks share a stream (torchrun's, a log file), and print's
    text and newline are two writes where stderr is unbuffered (python -u, PYTHONUNBUFFERED) --
    two ranks' lines given at once would run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class Guard:
    """Heartbeat, signal handling and flight-log dumps for one rank (see the module docstring).
    `comm.step` tells the dumps which step the rank was in."""

    def __init__(self, rt, comm, flight_dir: Path, session: float, heartbeat_timeout: float,
                 preempt_budget: float = 25.0):
        self.rt, self.comm, self.session = rt, comm, session
        self.budget = preempt_budget
        self.signalled: tuple[int, float] | None = None  # the first SIGTERM/SIGINT and when (monotonic): stop asked
        self.deadline: float | None = None  # (monotonic) past it, a stopping run exits at once
        self.stop_sig = signal.SIGTERM  # the signal the group stops on (stop_within)
        self.doing = "before the first step"  # what the main thread does (the line of a budget run out)
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
        for t in self.threads:  # after a clean run the store answers: the beat's last call ends within its timeout
            # (a thread left inside a store call can abort the interpreter's teardown); after a failure the
            # beat thread may be stuck on a dead store: it is a daemon, and the process ends by os._exit
            t.join(timeout=self.timeout + 2 * self.interval if clean else 2.0)
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
            say(f"braidtrain: rank {self.rt.rank}: {reason}; {where}; exiting")
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
                        self._signal(signum)
            now = time.monotonic()
            if self.deadline is not None and now > self.deadline and not self.stop.is_set():
                sig = self.signalled[0] if self.signalled else self.stop_sig
                self.fatal(f"signal {signal.Signals(sig).name}: --preempt-budget {self.budget:g} s ran out "
                           f"{self.doing}", 128 + sig)
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

    def _signal(self, signum: int) -> None:
        """(The watch thread.) The first SIGTERM or SIGINT asks the run to stop at the next step
        boundary; a second one, or any after a peer was lost, ends it now."""
        name, cause, now = signal.Signals(signum).name, self._peer_lost(), time.monotonic()
        if cause:
            self.fatal(f"peer lost: {cause} (then {name})", 128 + signum)
        if self.signalled is None:
            self.signalled, self.deadline = (signum, now), now + self.budget
            if self.rt.is_main:
                say(f"braidtrain: {name}: stopping after the step in progress and saving it (within "
                    f"--preempt-budget {self.budget:g} s); a second signal stops at once")
        elif now - self.signalled[1] > DUPLICATE_S:
            self.fatal(f"signal {name} (a second one: stopped at once)", 128 + signum)

    def stop_within(self, seconds: float, signum: int) -> None:
        """(The main thread, stopping on `signum`.) Exit at once if still alive in `seconds`: the
        group's least time left, so that a rank that was not signalled itself gives up with the others."""
        self.deadline, self.stop_sig = time.monotonic() + seconds, signum

    def left(self) -> float:
        """Seconds of this rank's --preempt-budget left (inf: not signalled)."""
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def failure(self, e: BaseException) -> str:
        """The flight log's reason for an exception in the loop: a peer lost first, if one was (a
        survivor that gave up leaves, and its partners' collectives fail on the closed connection
        before their own heartbeat reads the abort it published), else the exception."""
        cause = self._peer_lost()
        return f"peer lost: {cause} (then {crash_reason(e)})"[:500] if cause else crash_reason(e)

    def _peer_lost(self) -> str | None:
        """On a signal or a crash: whether a peer was lost first -- torchrun terminates every rank as
        soon as one has left, often before the others' heartbeat saw the abort that rank published;
        the flight log should then give the cause, not the signal. Asks the store once (briefly)."""
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
        # a peer's silence counts up to the store's last answer: beyond it nobody could have seen a beat
        # (a frozen store host would otherwise be named by its heartbeat or the store's, as timing falls)
        stale = [(p, self.store_ok - t) for p, t in list(self.seen.items())
                 if p not in self.done and self.store_ok - t > self.timeout]
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
                    say(f"braidtrain: rank {self.rt.rank}: ended rank {p} (pid {self.where[p][1]}), silent for "
                        f"{now - t:.1f} s")
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
