"""`braidtrain doctor`: what the ranks' flight logs say -- who stopped where, or who disagreed.

The flight log is `<run>/flight/rank_NNNNN.jsonl`: a header line (rank, world size, step, attempt,
session, time, reason, the members of every group it used), then comm.py's ring buffer of
collective records, oldest first. `diagnose` (the `doctor` subcommand) lines the ranks' logs up
group by group, by each group's own sequence number: a tp group may have run a hundred
collectives for every one of the world group, and a pipeline stage's sends are its pair's alone.
A rank that was frozen (SIGSTOP) or killed (SIGKILL) cannot write anything: it is named by the
absence of its file and by the collective its group's other members were left waiting in.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from braidtrain.collective.fault import MEMBERSHIP
from braidtrain.errors import UserError


def read_logs(flight_dir: Path) -> tuple[dict[int, dict], dict[int, list[dict]], list[str]]:
    """(headers, records, problems) of the latest session's logs; older sessions' files are ignored
    (their rank counts as silent), unreadable ones are reported."""
    logs, problems = {}, []
    for f in sorted(flight_dir.glob("rank_*.jsonl")):
        try:
            lines = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            if not lines or not all(isinstance(r, dict) for r in lines) or lines[0].get("flight") != 1 or \
                    not {"session", "rank"} <= set(lines[0]):
                raise ValueError("no header line")
            logs[f] = lines
        except (ValueError, OSError) as e:
            problems.append(f"{f.name} is unreadable ({e}); its rank counts as silent")
    if not logs:
        raise UserError(f"no readable flight log in {flight_dir}: {problems[0]}" if problems else
                        f"no flight logs in {flight_dir}: a rank writes one when it fails, is signalled, or loses a "
                        "peer")
    latest = max(lines[0]["session"] for lines in logs.values())
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
                rebuilt = not c["lost"] and not c.get("joined")  # (a verdict that proved false: no one to blame)
                if folder.is_dir() and any(folder.glob("rank_*.jsonl")):
                    out += [f"  {line}" for line in _diagnose_logs(folder, rebuilt)]
    if out and not any(flight.glob("rank_*.jsonl")):
        return out
    return out + _diagnose_logs(flight)


def _diagnose_logs(flight: Path, rebuilt: bool = False) -> list[str]:
    """`rebuilt`: the logs of a world that live recovery made again over the same members after a
    heartbeat verdict that proved false -- every member wrote its log and said it is here, so no rank
    stopped anything: where each was when the step was abandoned, not who held whom up."""
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
                what = "; ".join(f"{_ranks(rs)} issued {op} {g} "
                                 f"{dtype}{list(shape)}" for (op, shape, dtype), rs in sig.items())
                return out + [f"mismatch at collective #{k} (step {logs[min(logs)][k]['step']}): {what}"]
    if rebuilt:
        return out + [_abandoned(records)]
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
    culprits, tails, behind, named, stuck_elsewhere = [], [], [], set(), False
    for (g, k), waiters in sorted(points.items(), key=lambda p: min(waiting[r]["t_start"] for r in p[1])):
        group = members.get(g, range(world))
        for m in group:
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
                last = f"#{j}" + (f" ({_desc(issued[j])})" if issued else "")
                if any(s in group for s in silent):
                    # Not the cause: the group's silent member never came either. This one was still
                    # working towards #k when a signal or the heartbeat's verdict stopped it.
                    behind.append(f"rank {m} had not reached #{k} yet (its last: {last})")
                else:
                    culprits.append(f"rank {m} stopped at collective {last}")
            named.add(m)
        tails.append(f"{_ranks(waiters)} waited in #{k} ({_desc(waiting[waiters[0]])})")
    if not culprits and stuck_elsewhere:  # each waits for one who waits elsewhere
        return out + ["; ".join(tails) + ": each waits for a rank that waits elsewhere -- the ranks issued "
                      "their collectives in orders that cannot meet (a deadlock)"]
    if not culprits:  # everyone issued what they wait in, and it did not complete: the transport, not a rank
        what = ", and ".join(f"#{k} ({_desc(waiting[ws[0]])}) on {_ranks(ws)}" for (_, k), ws in points.items())
        return out + [f"every rank issued collective {what}, but it did not complete: look at the network / NCCL "
                      f"rather than at one rank"]
    return out + ["; ".join(culprits + tails + behind)]


def _abandoned(records: dict[int, list[dict]]) -> str:
    """Where each rank gave up when a verdict that proved false made every member abandon its step (or
    the final save): its oldest open collective, else its last completed one -- a stall, not a rank that
    stopped or a deadlock, whatever collectives the waits were in."""
    where = {}
    for r, recs in records.items():
        open_ = [x for x in recs if x["t_end"] is None]
        done = [x for x in recs if x["t_end"] is not None]
        if open_:
            x = min(open_, key=lambda x: x["seq"])
            where.setdefault(f"waited in #{x['gseq']} ({_desc(x)})", []).append(r)
        else:
            x = max(done, key=lambda x: x["seq"], default=None)
            where.setdefault("was between collectives" + (f" (its last: #{x['gseq']} ({_desc(x)}))" if x else ""),
                             []).append(r)
    return ("no rank was lost: a heartbeat verdict proved false (every member said it is here), so the members gave "
            "up where they were -- " + "; ".join(f"{_ranks(rs)} {w}" for w, rs in where.items())
            + " -- and made their world again over the same members")
