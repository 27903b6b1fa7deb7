"""Failures, end to end: a rank killed mid-step and restarted by torchrun, a frozen rank found by
the heartbeat and named by `doctor`, signals, a save that fails midway, damaged checkpoints, a
slow save that must not look like a lost peer -- and doctor's reasoning on hand-made flight logs.

Faults are injected with the BRAIDTRAIN_FAULT test hook (collective/inject.py). Every run here is exact
(or compared to itself), so "recovered" means: the same weights_sha256 as an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import torch.distributed as dist

from braidtrain.collective.fault import Guard
from helpers import ROOT, SMALL, braidtrain, env, hold_port, metrics, summary

D = 512
COMMON = [*SMALL, "-d", D, "-x", 8, "--exact"]


def torchrun(nproc: int, *args, fault: str | None = None, cwd=ROOT, restarts: int = 1) -> subprocess.Popen:
    e = env()
    if fault:
        e["BRAIDTRAIN_FAULT"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={restarts}", "-m", "braidtrain", "train", *map(str, args)]
    return subprocess.Popen(cmd, cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen, timeout: float = 240) -> tuple[str, str]:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"exit {p.returncode}\n{out[-3000:]}\n{err[-5000:]}"
    return out, err


def headers(run: Path) -> dict[int, dict]:
    return {int(f.stem[5:]): json.loads(f.read_text().splitlines()[0]) for f in (run / "flight").glob("rank_*.jsonl")}


def doctor(run: Path) -> str:
    p = braidtrain("doctor", run)
    return p.stdout


def verdict(report: str) -> dict[int, str]:
    """rank -> the clause of doctor's last line that names it ("rank 2 stopped ...", "ranks 0,3 waited
    in #40 ..."); the culprits' clauses come first. Every rank is named once."""
    said = {}
    for clause in report.strip().splitlines()[-1].split("; "):
        who = clause.split()[1]
        assert clause.startswith(("rank ", "ranks ")) and who.replace(",", "").isdigit(), report
        for r in map(int, who.split(",")):
            assert r not in said, report
            said[r] = clause
    return said


def while_frozen(p: subprocess.Popen, ready, wait_s: float, check) -> str:
    """A run with a SIGSTOPped rank: once ready() (or after wait_s), check() what the survivors
    left; then kill the frozen rank by pid -- torchrun's SIGTERM cannot reach a stopped process,
    so it would wait 30 s before SIGKILL -- and let torchrun restart the group. Its stdout."""
    err_lines: list[str] = []
    reader = threading.Thread(target=lambda: err_lines.extend(iter(p.stderr.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + wait_s
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.5)
    stopped = [line for line in err_lines if "fault injected: SIGSTOP" in line]
    pid = int(stopped[0].split("pid ")[1].split()[0]) if stopped else None
    try:
        check()
    except BaseException as e:
        p.terminate()  # torchrun stops its workers (the frozen one is killed below)
        raise AssertionError(f"{e}\n{''.join(err_lines)[-4000:]}") from e
    finally:
        if pid:
            try:  # (a survivor on this host may have ended it already: fault.Guard._end_frozen)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    out, _ = p.communicate(timeout=240)
    reader.join(5)
    assert p.returncode == 0, "".join(err_lines)[-4000:]
    return out


@pytest.fixture(scope="module")
def ref(tmp_path_factory, shakespeare) -> Path:
    """The uninterrupted run every recovery must reproduce bit for bit (1 rank, checkpoints at 4, 8)."""
    out = tmp_path_factory.mktemp("fault") / "ref"
    braidtrain("train", *COMMON, "-i", shakespeare, "--ckpt-every", 4, "--out", out)
    return out


def test_killed_rank_is_restarted_and_resumes_exactly(tmp_path, shakespeare, ref):
    """SIGKILL rank 2 of 4 in the middle of step 6 (checkpoint at 4): torchrun restarts the group,
    which resumes by itself -- no --resume, no --out: the restart must find the first attempt's run
    directory -- and ends with the uninterrupted run's weights. Then the state the kill left (the
    step-4 checkpoint) resumes on 2 ranks with ZeRO-3 and on 1 rank, with the same result."""
    p = torchrun(4, *COMMON, "-i", shakespeare, "--ckpt-every", 4, "-z", 1, "--heartbeat-timeout", 3,
                 fault="kill:rank=2:step=6", cwd=tmp_path)
    out, err = finish(p)
    assert "fault injected: SIGKILL" in err
    assert "torchrun restart 1" in out and "resumed from" in out and "step_00000004" in out
    (run,) = (tmp_path / "runs").iterdir()  # one run directory, shared by both attempts
    assert summary(run)["weights_sha256"] == summary(ref)["weights_sha256"]
    recs = metrics(run)
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert [r["loss"] for r in recs] == [r["loss"] for r in metrics(ref)]
    assert [r["step"] for r in recs if "load_s" in r] == [5]  # the first step after the resume
    # The survivors wrote flight logs (torchrun's SIGTERM); the killed rank could not.
    assert sorted(headers(run)) == [0, 1, 3]
    # Where each survivor was when torchrun's SIGTERM came is timing (waiting in the collective the
    # killed rank never joined, or still working towards it): every one must be accounted for.
    said = verdict(doctor(run))
    assert sorted(said) == [0, 1, 2, 3] and next(iter(said)) == 2, said  # the killed rank is the culprit
    assert said[2].startswith("rank 2 stopped after collective #") and "wrote no flight log" in said[2], said
    assert said[0] == said[3] and "waited in #" in said[0] and "step 6" in said[0], said
    assert said[1] == said[0] or said[1].startswith("rank 1 had not reached #"), said

    for nproc, zero in ((2, 3), (1, 0)):
        again = tmp_path / f"again{nproc}"
        shutil.copytree(run, again)
        shutil.rmtree(again / "checkpoints" / "step_00000008")
        (again / "summary.json").unlink()
        p = braidtrain("train", *COMMON, "-i", shakespeare, "--ckpt-every", 4, "-z", zero, "--out", again,
                       "--resume", "auto", nproc=nproc)
        assert f"world_size 4 -> {nproc}" in p.stdout and f"zero 1 -> {zero}" in p.stdout, p.stdout
        assert summary(again)["weights_sha256"] == summary(ref)["weights_sha256"]


def test_frozen_rank_is_detected_and_named(tmp_path, shakespeare, ref):
    """SIGSTOP rank 1 of 4 at step 3, heartbeat timeout 3 s, collective timeout 120 s: the three
    others must give up through the heartbeat (not the collective timeout), each writing its
    flight log, and doctor must name rank 1 -- which wrote nothing -- from their logs."""
    run = tmp_path / "run"
    p = torchrun(4, *COMMON, "-i", shakespeare, "--ckpt-every", 2, "--out", run, "--heartbeat-timeout", 3,
                 "--timeout", 120, fault="stop:rank=1:step=3")

    def check():
        h = headers(run) if (run / "flight").is_dir() else {}
        assert sorted(h) == [0, 2, 3], f"survivors' flight logs: {sorted(h)}"
        for r in (0, 2, 3):
            assert h[r]["reason"].startswith("peer lost:") and "rank 1" in h[r]["reason"], h[r]
            assert h[r]["step"] == 3
        said = verdict(doctor(run))
        assert sorted(said) == [0, 1, 2, 3] and next(iter(said)) == 1, said
        assert said[1].startswith("rank 1 stopped after collective #") and "wrote no flight log" in said[1], said
        # (a survivor that read another's verdict may have left before it reached that collective)
        assert all("waited in #" in said[r] or "had not reached #" in said[r] for r in (0, 2, 3)), said

    out = while_frozen(p, lambda: len(headers(run) if (run / "flight").is_dir() else {}) >= 3, 90, check)
    assert "resumed from" in out and "step_00000002" in out
    assert summary(run)["weights_sha256"] == summary(ref)["weights_sha256"]


def test_frozen_pipeline_stage_is_named_and_the_pipeline_resumes_exactly(tmp_path, shakespeare, ref):
    """pp 2: the last stage freezes right after its first forward of step 3. The first stage,
    1F1B, has sent its warm-up activations and waits for micro-batch 0's gradient; doctor names
    the silent rank and that transfer (the direction's group, 1>0, and the tensor). Then torchrun
    restarts the pipeline, which resumes from step 2's checkpoint by itself and ends with the
    uninterrupted one-rank run's weights."""
    run = tmp_path / "run"
    p = torchrun(2, *COMMON, "-i", shakespeare, "--pp", 2, "--out", run, "--ckpt-every", 2, "--heartbeat-timeout", 3,
                 "--timeout", 120, fault="stop:rank=1:step=3")

    def check():
        report = doctor(run)
        assert "rank 1 stopped after collective #" in report and "wrote no flight log" in report, report
        assert "rank 0 waited in #" in report and "(p2p pp[1>0], step 3, recv grad chunk 0 micro 0)" in report, report

    out = while_frozen(p, lambda: (run / "flight" / "rank_00000.jsonl").is_file(), 60, check)
    assert "resumed from" in out and "step_00000002" in out
    assert summary(run)["weights_sha256"] == summary(ref)["weights_sha256"]


def test_frozen_store_host_is_detected(tmp_path, shakespeare):
    """Started by hand (-pi tcp), rank 0 hosts the store; freezing it freezes the store too, which
    can block a store call forever. Rank 1 must still give up within its heartbeat timeout."""
    held = hold_port()
    port = held.getsockname()[1]
    run, e = tmp_path / "run", dict(env(), BRAIDTRAIN_FAULT="stop:rank=0:step=3")
    procs = [subprocess.Popen([sys.executable, "-m", "braidtrain", "train", *map(str, COMMON), "-i", str(shakespeare),
                               "--out", str(run), "-pi", "tcp", "-ps", f"127.0.0.1:{port}", "-pn", "2", "-pr", str(r),
                               "--heartbeat-timeout", "3", "--timeout", "120"],
                              cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        _, err = procs[1].communicate(timeout=90)
    finally:
        procs[0].kill()  # frozen: only SIGKILL ends it
        procs[0].communicate()
        held.close()
    assert procs[1].returncode == 75, err
    # Which silence the judge saw first -- the store's or rank 0's heartbeat (its beat thread may have
    # been starved of the CPU just before it froze, while the store's own thread still answered) -- is timing.
    assert "rank 1: peer lost: the rendezvous store has not answered" in err or \
        "rank 1: peer lost: rank 0 sent no heartbeat" in err, err
    assert "rank 0 stopped after collective #" in doctor(run)


def test_slow_save_is_not_a_lost_peer(tmp_path, shakespeare):
    """A rank that spends 6 s in a checkpoint save, with a 2 s heartbeat timeout: its heartbeat
    thread beats on, so nobody gives up, and the run ends cleanly, without flight logs."""
    run = tmp_path / "run"
    p = torchrun(2, *SMALL, "-i", shakespeare, "-d", D, "-x", 3, "--ckpt-every", 2, "--out", run,
                 "--heartbeat-timeout", 2, fault="slow-save:rank=1:step=2:seconds=6", restarts=0)
    _, err = finish(p)
    assert "checkpoint save sleeps 6 s" in err
    assert not (run / "flight").exists(), err


def test_sigterm_writes_the_flight_log(tmp_path, shakespeare):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "braidtrain", "train", *map(str, SMALL), "-i", str(shakespeare), "-x", 100000,
           "--out", str(run)]
    p = subprocess.Popen(list(map(str, cmd)), cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "braidtrain: rank 0: signal SIGTERM; flight log" in err
    lines = (run / "flight" / "rank_00000.jsonl").read_text().splitlines()
    head = json.loads(lines[0])
    assert head["reason"] == "signal SIGTERM" and head["step"] >= 1 and head["world_size"] == 1
    assert all(json.loads(line)["op"] for line in lines[1:])


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, shakespeare, ref):
    """The save of step 6 fails after the rank's file is written (an injected ENOSPC): one clear
    line, the step-4 checkpoint intact and used, the half-written one never read, and the resumed
    run ends with the uninterrupted run's weights."""
    from braidtrain.io import checkpoint

    run = tmp_path / "run"
    p = braidtrain("train", *COMMON, "-i", shakespeare, "--ckpt-every", 2, "--out", run,
                   environ=dict(env(), BRAIDTRAIN_FAULT="save:step=6"), check=False)
    assert p.returncode == 2, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("braidtrain: error:") and "No space left" in last and "previous checkpoint is intact" in last
    ckpts = sorted(d.name for d in (run / "checkpoints").iterdir())
    assert ckpts == ["step_00000002", "step_00000004"]  # (the failed save's partial files removed)
    checkpoint.verify(run / "checkpoints" / "step_00000004")
    assert headers(run)[0]["reason"].startswith("crash: SaveFailed")
    out = braidtrain("train", *COMMON, "-i", shakespeare, "--ckpt-every", 2, "--out", run, "--resume", "auto").stdout
    assert "step_00000004" in out
    assert summary(run)["weights_sha256"] == summary(ref)["weights_sha256"]
    assert sorted(d.name for d in (run / "checkpoints").iterdir()) == ["step_00000006", "step_00000008"]


DAMAGE = {
    "truncated": (lambda d: (d / "rank_00000.safetensors").write_bytes((d / "rank_00000.safetensors").read_bytes()[:-100]),
                  "rank_00000.safetensors is truncated"),
    "flipped": (lambda d: _flip(d / "rank_00000.safetensors"), "does not match its checksum"),
    "missing file": (lambda d: (d / "rank_00000.safetensors").unlink(), "rank_00000.safetensors is missing"),
    "no meta": (lambda d: (d / "meta.json").unlink(), "incomplete (no meta.json)"),
    "bad meta": (lambda d: (d / "meta.json").write_text("{\"format\": 1, \"fil"), "meta.json is damaged"),
}


def _flip(f: Path):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_checkpoint_falls_back(tmp_path, ref, kind):
    """The newest checkpoint damaged one way or another: a warning that says how, and the previous one."""
    from braidtrain.io import checkpoint

    ckpts = tmp_path / "checkpoints"
    shutil.copytree(ref / "checkpoints", ckpts)
    damage, message = DAMAGE[kind]
    damage(ckpts / "step_00000008")
    warnings = []
    assert checkpoint.find_resume("auto", ckpts, warnings.append) == ckpts / "step_00000004"
    assert len(warnings) == 1 and message in warnings[0] and "step_00000008" in warnings[0], warnings


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path, shakespeare, ref):
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    args = [*COMMON, "-i", shakespeare, "--out", run, "--resume", "auto", "--n-embd", 32]
    p = braidtrain("train", *args, check=False)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert "different model" in err[0] and "step_00000008" in err[0]
    assert summary(run) == summary(ref)  # nothing trained, nothing overwritten


# ----------------------------------------------------------------------------- doctor, by hand

def write_logs(run: Path, logs: dict[int, list[tuple]], world: int = 4, session: float = 1000.0, reason="peer lost",
               groups=None):
    """logs: rank -> [(seq, op, done)] or [(seq, op, done, group, gseq)]; float32[8], step 40 + seq // 10; the
    group replica (every rank) unless given. `groups`: name -> members, as each header lists them."""
    (run / "flight").mkdir(parents=True, exist_ok=True)
    for rank, recs in logs.items():
        head = {"flight": 1, "rank": rank, "world_size": world, "step": 41, "attempt": 0, "session": session,
                "time": session + 5, "reason": reason, "groups": groups or {"replica": list(range(world))}}
        lines = [head]
        for s, op, done, *where in recs:
            group, gseq = where or ("replica", s)
            lines.append({"seq": s, "op": op, "group": group, "gseq": gseq, "shape": [8], "dtype": "float32",
                          "nbytes": 32, "t_start": 1.0 + s, "t_end": 2.0 + s if done else None, "step": 40 + s // 10})
        (run / "flight" / f"rank_{rank:05d}.jsonl").write_text("".join(json.dumps(rec) + "\n" for rec in lines))


def history(n: int, *tail) -> list[tuple]:
    return [(s, "all_reduce", True) for s in range(n)] + list(tail)


def test_doctor_names_the_rank_that_stopped(tmp_path):
    from braidtrain.collective.doctor import diagnose

    logs = {r: history(13, (13, "all_gather", False)) for r in (0, 1, 2)}
    logs[3] = history(13)  # stopped after #12: it never issued #13
    write_logs(tmp_path, logs)
    assert diagnose(tmp_path)[-1] == ("rank 3 stopped at collective #12 (all_reduce replica, step 41); "
                                      "ranks 0,1,2 waited in #13 (all_gather replica, step 41)")


def test_doctor_blames_the_silent_rank_not_one_that_was_behind(tmp_path):
    """Rank 2 killed after #12; torchrun's SIGTERM found ranks 0,3 waiting in #13 and rank 1 still
    working towards it (test_killed_rank_is_restarted_and_resumes_exactly, as timing falls): rank 1
    did not stop anything -- #13 could never complete without rank 2 -- so it is not a culprit."""
    from braidtrain.collective.doctor import diagnose

    logs = {r: history(13, (13, "all_gather", False)) for r in (0, 3)}
    logs[1] = history(13)
    write_logs(tmp_path, logs, reason="signal SIGTERM")
    assert diagnose(tmp_path)[-1] == ("rank 2 stopped after collective #12 (all_reduce replica, step 41) and wrote no "
                                      "flight log (frozen or killed); ranks 0,3 waited in #13 (all_gather replica, "
                                      "step 41); rank 1 had not reached #13 yet (its last: #12 (all_reduce replica, "
                                      "step 41))")


def test_doctor_infers_a_silent_rank_and_ignores_older_sessions(tmp_path):
    from braidtrain.collective.doctor import diagnose

    write_logs(tmp_path, {1: history(5)}, session=500.0)  # rank 1's file from an earlier session
    write_logs(tmp_path, {r: history(13, (13, "all_gather", False), (14, "all_reduce", False)) for r in (0, 2, 3)})
    lines = diagnose(tmp_path)
    assert "none from rank 1" in lines[0]
    assert any("rank_00001.jsonl is from an earlier session" in line for line in lines)
    assert lines[-1].startswith("rank 1 stopped after collective #12 (all_reduce replica, step 41) and wrote no "
                                "flight log")
    assert lines[-1].endswith("ranks 0,2,3 waited in #13 (all_gather replica, step 41)")


def test_doctor_finds_mismatched_collectives(tmp_path):
    from braidtrain.collective.doctor import diagnose

    logs = {r: history(20, (20, "all_reduce", False)) for r in (0, 1, 2, 3)}
    logs[2][17] = (17, "all_gather", False)
    write_logs(tmp_path, logs)
    last = diagnose(tmp_path)[-1]
    assert last.startswith("mismatch at collective #17 (step 41): ranks 0,1,3 "
                           "issued all_reduce") and "rank 2 issued all_gather" in last


def test_a_crash_after_a_peer_was_lost_names_the_peer(tmp_path):
    """A survivor's collective that fails because another survivor gave up (a closed connection)
    before this rank's own heartbeat read the abort: the flight log's reason is the lost peer that
    the store names, then the crash -- and a crash with no peer lost stays a crash."""
    store = dist.HashStore()
    rt = SimpleNamespace(rank=2, world_size=4, attempt=0, connect=lambda timeout: store)
    guard = Guard(rt, None, tmp_path, 0.0, heartbeat_timeout=600)  # (no verdict of its own in this test)
    guard.start()
    try:
        err = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:9100: Connection reset by peer")
        assert guard.failure(err).startswith("crash: RuntimeError: [gloo"), guard.failure(err)
        store.set("hb/abort", "rank 0 saw: rank 1 sent no heartbeat for 3.1 s (dead or frozen)")
        reason = guard.failure(err)
        assert reason.startswith("peer lost: rank 0 saw: rank 1 sent no heartbeat"), reason
        assert "(then crash: RuntimeError: [gloo" in reason, reason
    finally:
        guard.close(clean=True)


def test_a_fatal_line_is_one_write(tmp_path):
    """Guard.fatal's line reaches stderr in one write, its newline with it: where stderr is
    unbuffered (PYTHONUNBUFFERED, python -u) print's text and newline are two writes, and two ranks'
    lines given at once ran together on a shared stream ("...; exitingbraidtrain: rank 3: ...", a
    live test's two survivors falling back under load)."""
    code = ("import os, sys\n"
            "from types import SimpleNamespace as S\n"
            "from braidtrain.collective.fault import Guard\n"
            "class Writes:\n"
            "    def write(self, s): os.write(1, (repr(s) + '\\n').encode())\n"
            "    def flush(self): pass\n"
            "sys.stderr = Writes()\n"
            "guard = Guard(S(rank=3, world_size=4, attempt=0), S(step=5, seq=0, dump=lambda p, h: None), '.', 0.0, 0)\n"
            "guard.fatal('peer lost: a test', 75)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 75, p.stderr
    assert p.stdout.splitlines() == [repr("braidtrain: rank 3: peer lost: a test; flight log rank_00003.jsonl; exiting\n")]


def test_doctor_says_when_all_is_well(tmp_path):
    from braidtrain.collective.doctor import diagnose

    write_logs(tmp_path, {r: history(9) for r in range(4)}, reason="signal SIGTERM")
    assert diagnose(tmp_path)[-1] == "no problem found: every rank's last collective completed"
    lines = braidtrain("doctor", tmp_path / "nowhere", check=False)
    assert lines.returncode == 2 and lines.stderr.count("\n") == 1 and "no flight/ folder" in lines.stderr


def test_doctor_lines_up_each_group_on_its_own(tmp_path):
    """dp 2 x tp 2: the tp groups run ~60 collectives for every one of the world group, so the ranks'
    own counts disagree; rank 1 freezes inside its tp group's collective #57. Doctor must name it by
    that group -- where its tp partner was left waiting -- and list the others, each waiting in its
    replica group (rank 2 behind rank 0, rank 3 behind rank 1), without blaming either."""
    from braidtrain.collective.doctor import diagnose

    groups = {"world": [0, 1, 2, 3], "tp[0,1]": [0, 1], "tp[2,3]": [2, 3], "replica[0,2]": [0, 2], "replica[1,3]": [1, 3]}

    def rank_log(tp, tp_done, replica=None):
        recs = [(0, "barrier", True, "world", 0)]
        recs += [(1 + k, "all_reduce", k < tp_done, tp, k) for k in range(tp_done + (tp_done < 58))]
        if replica:
            recs.append((len(recs), "reduce_scatter", False, replica, 3))
        return recs

    write_logs(tmp_path, {0: rank_log("tp[0,1]", 57), 2: rank_log("tp[2,3]", 58, "replica[0,2]"),
                          3: rank_log("tp[2,3]", 58, "replica[1,3]")}, groups=groups)
    lines = diagnose(tmp_path)
    assert "none from rank 1" in lines[0]
    assert lines[-1] == ("rank 1 stopped after collective #56 (all_reduce tp[0,1], step 45) and wrote no flight log "
                         "(frozen or killed); rank 0 waited in #57 (all_reduce tp[0,1], step 45); "
                         "rank 2 waited in #3 (reduce_scatter replica[0,2], step 45); "
                         "rank 3 waited in #3 (reduce_scatter replica[1,3], step 45)"), lines[-1]


def test_doctor_names_a_deadlock_between_two_groups(tmp_path):
    """Rank 0 waits in group a for rank 1, which waits in group b for rank 0: nobody stopped; the
    order of their collectives cannot meet."""
    from braidtrain.collective.doctor import diagnose

    groups = {"a": [0, 1], "b": [0, 1]}
    write_logs(tmp_path, {0: [(0, "send_recv", True, "a", 0), (1, "send_recv", False, "a", 1)],
                          1: [(0, "send_recv", True, "a", 0), (1, "all_reduce", False, "b", 0)]}, world=2, groups=groups)
    last = diagnose(tmp_path)[-1]
    assert last.startswith("rank 0 waited in #1 (send_recv a, step 40); rank 1 waited in #0 (all_reduce b, step 40)")
    assert "deadlock" in last, last


def test_doctor_blames_no_rank_when_every_member_issued_the_collective(tmp_path):
    """dp 2 x tp 2, all four ranks inside their replica group's #3, each issued by both members: no
    rank held anyone up (nor is it a deadlock); the collectives themselves did not complete."""
    from braidtrain.collective.doctor import diagnose

    groups = {"replica[0,2]": [0, 2], "replica[1,3]": [1, 3]}
    write_logs(tmp_path, {r: [(0, "all_reduce", True, f"replica[{r % 2},{r % 2 + 2}]", 0),
                              (1, "reduce_scatter", False, f"replica[{r % 2},{r % 2 + 2}]", 1)] for r in range(4)},
               groups=groups)
    assert diagnose(tmp_path)[-1] == ("every rank issued collective #1 (reduce_scatter replica[0,2], step 40) on "
                                      "ranks 0,2, and #1 (reduce_scatter replica[1,3], step 40) on ranks 1,3, but it "
                                      "did not complete: look at the network / NCCL rather than at one rank")


def test_doctor_reads_flight_logs_from_before_groups_were_named(tmp_path):
    """A log of the code before: records with a mesh axis and one count per rank, no group table."""
    from braidtrain.collective.doctor import diagnose

    write_logs(tmp_path, {r: history(13, (13, "all_gather", False)) for r in (0, 1, 2)} | {3: history(13)})
    for f in (tmp_path / "flight").iterdir():
        lines = [json.loads(line) for line in f.read_text().splitlines()]
        del lines[0]["groups"]
        for x in lines[1:]:
            x["axis"] = x.pop("group")
            del x["gseq"]
        f.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    assert diagnose(tmp_path)[-1] == ("rank 3 stopped at collective #12 (all_reduce replica, step 41); "
                                      "ranks 0,1,2 waited in #13 (all_gather replica, step 41)")


def test_a_replayed_graph_is_one_flight_record_per_step(tmp_path):
    """--cuda-graph: the collectives captured with the step are recorded once, at the capture; each
    replay adds one record (the same on every rank), open until the step's results were used --
    so that doctor still names the rank that stopped, in steps -- and the replayed collectives'
    timing events count for the step, beside any collective launched eagerly between steps."""
    import torch

    from braidtrain.collective.comm import Comm
    from braidtrain.collective.group import Group
    from braidtrain.collective.flight import Handle
    from braidtrain.collective.doctor import diagnose

    class Event:  # what Comm reads of a CUDA timing event pair: the start's, and a finished end
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, _end):
            return self.ms

        def query(self):
            return True

    def of_two(axis, comm):  # rank comm.r's group of both ranks (no process group: nothing is sent)
        return Group(axis, (0, 1), comm.r, None, comm, axis)

    def launch(comm, op, ms):  # a collective on a GPU, as Comm._launch leaves it
        h = Handle(comm, comm._record(op, of_two("replica", comm), (8,), "float32", 32), None, events=(Event(ms), Event(ms)))
        h.bus_bytes = 32
        comm.step_handles.append(h)
        return h

    def rank(r: int, last_step: int, done: bool):
        comm = Comm(torch.device("cpu"))
        comm.r = r
        comm.begin_step(3)
        captured = [launch(comm, "all_reduce", 2.0), launch(comm, "all_gather", 2.0)]
        assert comm.step_comm() == (0.004, 64)
        for step in range(4, last_step + 1):
            comm.begin_step(step)
            comm.replayed(captured, of_two("world", comm))
            assert comm.records[-1].t_end is None  # open while the step runs
            if step < last_step or done:
                assert comm.step_comm() == ((0.004, 64) if step == 4 else (0.005, 96))
                if step < 6:  # between two steps, e.g. validation's: counted with the next step
                    launch(comm, "all_gather", 1.0)
        head = {"flight": 1, "rank": r, "world_size": 2, "step": last_step, "attempt": 0, "session": 1000.0,
                "time": 1005.0, "reason": "peer lost"}
        comm.dump(str(tmp_path / "flight" / f"rank_{r:05d}.jsonl"), head)
        return list(comm.records)

    recs = rank(0, 6, done=True)
    assert [(x.op, x.step) for x in recs] == [("all_reduce", 3), ("all_gather", 3), ("graph_replay", 4), ("all_gather", 4),
                                              ("graph_replay", 5), ("all_gather", 5), ("graph_replay", 6)]
    assert [(x.nbytes, x.shape) for x in recs if x.op == "graph_replay"] == [(64, (2,))] * 3
    assert all(x.t_end is not None for x in recs)
    rank(1, 6, done=True)
    assert diagnose(tmp_path)[-1] == "no problem found: every rank's last collective completed"
    rank(0, 6, done=False)  # rank 0 waits in step 6's replay; rank 1 never launched it
    rank(1, 5, done=True)
    # (numbered in the group rank 0 waits in: the world's replays, #0 step 4, #1 step 5, #2 step 6)
    assert diagnose(tmp_path)[-1] == ("rank 1 stopped at collective #1 (graph_replay world, step 5); "
                                      "rank 0 waited in #2 (graph_replay world, step 6)")


@pytest.mark.parametrize("spec, words", [("explode:step=3", "unknown kind"), ("kill:rank=1", "at which step"),
                                          ("kill:step=x", "expected KIND:step=S")])
def test_bad_fault_spec(spec, words):
    from braidtrain.errors import UserError
    from braidtrain.collective.inject import Fault

    with pytest.raises(UserError, match=words):
        Fault(spec)


def test_one_chaos_trial_ends_bitwise_equal(tmp_path, shakespeare):
    """benchmarks/fault/chaos.py, one trial (seed 24: rank 0 of 2 frozen at step 6 under ZeRO-1, the
    survivor ends it after the 5 s heartbeat timeout, the restart on 1 process): the final weights
    are the uninterrupted run's, and the survivor ended the frozen rank (its timing is load's: no assertion)."""
    out = tmp_path / "chaos.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fault" / "chaos.py"), "--trials", "1", "--seed", "24",
                        "--data", str(shakespeare), "--json", str(out)], cwd=ROOT, env=env(), capture_output=True,
                       text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    (r,) = json.loads(out.read_text())
    assert r["ok"] and r["fault"] == "stop rank 0 at step 6" and r["world"] == "2 -> 1" and r["first_exit"] != 0
    assert r["ended_by_peer"], r  # the survivor's heartbeat ended the frozen rank, not torchrun's SIGKILL 30 s later
