"""Who is still here: live recovery's agreement on the members, through the rendezvous store.

Each survivor of epoch E says it is here (live/E/here/RANK: the steps it has done, its pid, and
-- if it applied the step's update -- the update's clip scale and skip flag); the first to see every
member here or lost writes the decision (live/E/next, compare_set: one decision, read by all). A
member counts as lost when its process is gone from this host (/proc), or its heartbeat has been
silent for --heartbeat-timeout. A lost member still alive on this host is SIGKILLed once the
decision is read (a frozen one would wake into a world that went on without it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time

import torch.distributed as dist

from braidtrain.collective.flight import Aborted
from braidtrain.collective.fault import MEMBERSHIP

TRANSPORT = ("connection closed", "connection reset", "broken pipe", "timed out", "gloo", "socket")


def agree(store, e: int, ids: list[int], guard, timeout: float, heartbeat_timeout: float,
          replica=lambda r: r) -> dict:
    """Epoch e's decision: {"members", "lost": {rank: why}, "done": {rank: steps}, "pids", "update",
    "errors": {rank: its error, None where it gave up a wait}}
    ("update": what a member that applied the step's update reported, or None). A lost rank takes
    its replica out (`replica`: a rank's, live/replicas.py): the members are the ranks here of the
    other replicas; "pids" has every rank here, those of a retired replica too."""
    key, deadline, since = f"live/{e}/next", time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        if store.check([key]):
            decision = json.loads(store.get(key))
            for p in decision.get("lost", {}):  # (after the decision: its reasons are the ones seen before)
                end(guard, int(p))
            return decision
        here = {p: json.loads(store.get(f"live/{e}/here/{p}")) for p in ids if store.check([f"live/{e}/here/{p}"])}
        lost = {p: why for p in ids if p not in here and (why := judge(guard, p, since, heartbeat_timeout))}
        if len(here) + len(lost) == len(ids):
            applied = [h["update"] for h in here.values() if h.get("update") is not None]
            retired = {replica(p) for p in lost}
            decision = {"members": [p for p in ids if p in here and replica(p) not in retired], "lost": lost,
                        "done": {p: h["done"] for p, h in here.items()}, "pids": {p: h["pid"] for p, h in here.items()},
                        "errors": {p: h["error"] for p, h in here.items()},
                        "update": applied[0] if applied else None}
            store.compare_set(key, "", json.dumps(decision))
            continue
        time.sleep(0.05)
    raise TimeoutError(f"no agreement on the members within {timeout:g} s")


def complete(store, e: int) -> bool:
    """(Rank 0, past the run's last collective.) The run is complete: epoch e's decision, unless a
    recovery decided first (then False: that decision stands). Every collective of the run needed
    every member's part, so a member whose wait is given up after this (a verdict in the moment
    before it saw the last collective complete) has nothing left to do: its agreement reads this and
    it ends as a finished run's rank (exit 0). The same key as a recovery's decision, so that the two
    exclude each other; rank 0 keeps the store up until every member has closed its connection
    (collective/runtime.py's close, bounded), so a member in its agreement can read it."""
    mark = json.dumps({"complete": True})
    return store.compare_set(f"live/{e}/next", "", mark).decode() == mark


def leave_together(store, e: int, ids: list[int], me: int, wait: float) -> None:
    """Before the ranks `ids` (every one still here) fall back to the restart path together: each
    says so, and rank 0 -- whose process hosts the store -- waits (up to `wait` seconds) until all have
    read the decision."""
    try:
        store.set(f"live/{e}/leaving/{me}", "1")
        deadline = time.monotonic() + wait
        while me == ids[0] and time.monotonic() < deadline and not store.check([f"live/{e}/leaving/{p}" for p in ids]):
            time.sleep(0.05)
    except Exception:  # the store is gone already: nothing to wait for
        pass


def judge(guard, p: int, since: dict, heartbeat_timeout: float) -> str | None:
    """Why member p counts as lost, or None: its process gone from this host, or its heartbeat
    silent for the timeout (seen by this rank's guard, else since this recovery began)."""
    where = guard.where.get(p)
    if where and where[0] == socket.gethostname() and gone(where[1]):
        return f"its process, pid {where[1]}, exited"
    now = time.monotonic()
    last = guard.seen.get(p, since.setdefault(p, now))
    if now - last > heartbeat_timeout:
        return f"no heartbeat for {now - last:.1f} s: frozen or dead"
    return None


def end(guard, p: int) -> None:
    """SIGKILL a lost member that runs on this host."""
    where = guard.where.get(p)
    if where and where[0] == socket.gethostname() and not gone(where[1]):
        try:
            os.kill(where[1], signal.SIGKILL)
        except OSError:
            pass


def gone(pid: int) -> bool:
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


def record(out, change: dict) -> None:
    """One membership change, appended to RUN/flight/membership.jsonl (doctor reads it)."""
    (out / "flight").mkdir(parents=True, exist_ok=True)
    with open(out / "flight" / MEMBERSHIP, "a") as f:
        f.write(json.dumps(change) + "\n")


def ranks(rs) -> str:
    """'rank 2' / 'ranks 1,2'."""
    rs = sorted(int(r) for r in rs)
    return f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}"


def first_line(e: BaseException) -> str:
    """The error's first line, without gloo's source location and advice."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = re.sub(r"^\[[^\]]*\] ", "", text).split(". This is typically")[0]
    return text[:300]


def is_transport(e: BaseException) -> bool:
    text = str(e).lower()
    transport = isinstance(e, RuntimeError) and any(w in text for w in TRANSPORT)
    return isinstance(e, (Aborted, dist.DistError)) or transport
