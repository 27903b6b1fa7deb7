"""Live recovery (--live-recovery, braidtrain/live/): 4 ranks started by hand (-pi tcp), one of
them killed (SIGKILL) or frozen (SIGSTOP) in the middle of a step by the BRAIDTRAIN_FAULT hook. The
others must go on in the same processes -- the pids that finish are the pids that started -- redo
that step with the lost rank's micro-batches divided among them, log every step once, and end, in
--exact, with the weights of a run that never lost a rank: at every ZeRO stage (1-3 through the
buddy copies, parallel/mirror.py). The stage, the rank and the step are drawn at random, from a seed
each test prints (BRAIDTRAIN_TEST_SEED=S runs the same draw again). The kill goes through
scripts/live.sh (the launch path users take); the others through the tests' fork server. Plus the
tree that makes the redone step exact, against parallel/exact.py's, and the one-line refusals and
fallbacks. Under pp or tp a lost rank retires its whole replica (live/replicas.py): its live partner
leaves in one line, the other replica goes on, bitwise as ever."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import ROOT, SMALL, _start, braidtrain, env, hold_port, metrics, summary

D, STEPS = 2048, 8  # 4 micro-batches of b 2 x t 64 per rank at dp 4: a lost rank's 4 go 2, 1, 1 to three
COMMON = [*SMALL, "-d", D, "-x", STEPS, "--exact", "--heartbeat-timeout", 3, "--timeout", 60, "--bucket-mb", 0.01]
SEED = int(os.environ.get("BRAIDTRAIN_TEST_SEED") or random.SystemRandom().randrange(10**6))


def draw(test: str, **choices) -> dict:
    """One random pick from each of `choices` for this test, from SEED and the test's name -- printed
    (pytest shows it with a failure) and returned."""
    rnd = random.Random(f"{SEED}:{test}")
    got = {k: rnd.choice(list(v)) for k, v in choices.items()}
    print(f"{test}: BRAIDTRAIN_TEST_SEED={SEED} drew {got}")
    return got


@pytest.fixture(scope="module")
def ref(tmp_path_factory, shakespeare) -> Path:
    """The run that never lost a rank (one process: exact mode's bits are dp's too)."""
    out = tmp_path_factory.mktemp("live") / "ref"
    braidtrain("train", *COMMON, "-i", shakespeare, "--out", out)
    return out


def by_hand(nproc: int, args: list, fault: str | dict, tmp: Path, join: int | None = None,
            bad: list | None = None) -> tuple[dict, dict, str, str]:
    """nproc ranks of `braidtrain train ARGS --live-recovery -pi tcp`, each forked by the fork server
    (tests/forkserver.py) -- `fault`: BRAIDTRAIN_FAULT, or each rank's -- and with `join` a process
    asking to join in place of that rank (key "join"), and with `bad` flags one asking to join for
    rank 3 with them too (key "bad"); returns ({rank: pid}, {rank: exit code}, stdout, stderr)."""
    held = hold_port()  # closed when the ranks are done
    port = held.getsockname()[1]
    out, err = tmp / "out.txt", tmp / "err.txt"
    out.touch(), err.touch()
    target = ["-m", "braidtrain", "train", *map(str, args), "--live-recovery", "-pi", "tcp", "-ps", f"127.0.0.1:{port}",
              "-pn", str(nproc)]
    how = {r: ["-pr", str(r)] for r in range(nproc)} | ({"join": ["-pr", str(join), "--join"]} if join is not None else {})
    how |= {"bad": ["-pr", "3", "--join", *bad]} if bad else {}
    ranks = {r: _start(dict(target=[*target, *flags], cwd=str(ROOT), out=str(out), err=str(err), fsize=None,
                            env=dict(env(), BRAIDTRAIN_FAULT=fault if isinstance(fault, str) else fault.get(r, ""))))
             for r, flags in how.items()}
    codes = {}
    try:
        for r, (conn, f, _pid) in ranks.items():
            conn.settimeout(240)
            codes[r] = int(f.readline() or -9)
    finally:
        for conn, f, pid in ranks.values():
            if pid and not f.closed:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            f.close(), conn.close()
        held.close()
    return {r: pid for r, (_, _, pid) in ranks.items()}, codes, out.read_text(), err.read_text()


def membership(run: Path, rebuilt: bool = False) -> list[dict]:
    """The membership log's changes of members -- and with `rebuilt` the worlds made again over the same
    members after a heartbeat verdict that proved false, which a stall of a loaded machine can cause
    at any step (the rebuilt world's epoch counts in doctor's numbers: changed())."""
    changes = [json.loads(line) for line in (run / "flight" / "membership.jsonl").read_text().splitlines() if line.strip()]
    return [c for c in changes if rebuilt or c["lost"] or c.get("joined")]


def changed(report: str, step: int, what: str) -> bool:
    """doctor's report names a change at `step` that begins with `what` (whatever its epoch)."""
    return re.search(rf"membership change \d+ at step {step}: {re.escape(what)}", report) is not None


def check_went_on(run: Path, ref: Path, pids: dict, lost: int, step: int, zero: int, joined: int | None = None) -> None:
    """Every step logged once, the lost rank's step redone by the three others -- the processes that
    started -- (and the world grown back at step `joined`), and the final weights the uninterrupted run's."""
    recs = metrics(run)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in recs] == [r["loss"] for r in metrics(ref)]
    assert [r["step"] for r in recs if "recover_s" in r] == [step] and recs[step - 1]["world_size"] == 3
    assert [r["step"] for r in recs if "join_s" in r] == ([joined] if joined else [])
    change, *grown = membership(run)
    if joined:
        (grow,) = grown
        assert grow["members"] == [0, 1, 2, 3] and grow["joined"] == [lost] and grow["step"] == joined
        assert grow["pids"] == {str(lost): pids["join"]} and recs[joined - 1]["world_size"] == 4
    survivors = [r for r in range(4) if r != lost]
    assert change["members"] == survivors and list(change["lost"]) == [str(lost)] and change["step"] == step
    buddy = f"rank {lost - 1}'s copy of rank {lost}'s ZeRO-{zero} shard promoted and the state re-sharded over 3 ranks"
    assert (buddy in change["what"]) == (zero > 0), change["what"]
    assert {int(r): p for r, p in change["pids"].items()} == {r: pids[r] for r in survivors}
    assert summary(run)["step"] == STEPS
    assert summary(run)["weights_sha256"] == summary(ref)["weights_sha256"]
    report = braidtrain("doctor", run).stdout
    assert changed(report, step, f"rank {lost} lost"), report
    assert f"rank {lost} stopped after collective #" in report and "wrote no flight log" in report, report


def test_killed_rank_is_replaced_by_the_others_in_flight(tmp_path, shakespeare, ref):
    """scripts/live.sh starts 4 ranks; one of them is SIGKILLed in the middle of a step. The others
    see its connections close, agree without it, take its shard from its buddy's copy (ZeRO 1-3) and
    redo the step -- no restart, no step lost."""
    d = draw("kill", zero=range(4), rank=range(1, 4), step=range(2, STEPS + 1))
    run = tmp_path / "run"
    p = subprocess.run([str(ROOT / "scripts" / "live.sh"), *map(str, COMMON), "-z", str(d["zero"]), "-i", str(shakespeare),
                        "--out", str(run)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(env(), NPROC="4", BRAIDTRAIN_FAULT=f"kill:rank={d['rank']}:step={d['step']}"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert "fault injected: SIGKILL" in p.stderr
    pids = {int(r): int(pid) for r, pid in re.findall(r"live.sh: rank (\d+): pid (\d+)", p.stderr)}
    exits = {int(r): int(c) for r, c in re.findall(r"live.sh: rank (\d+) \(pid \d+\) exited (\d+)", p.stderr)}
    assert exits == {r: 137 if r == d["rank"] else 0 for r in range(4)}, p.stderr[-3000:]
    assert f"live recovery at step {d['step']}: rank {d['rank']} lost (its process" in p.stdout, p.stdout
    check_went_on(run, ref, pids, lost=d["rank"], step=d["step"], zero=d["zero"])


def test_frozen_rank_is_found_by_the_heartbeat_and_replaced(tmp_path, shakespeare, ref):
    """A rank frozen (SIGSTOP) in a step, heartbeat timeout 3 s: the others give up waiting for it,
    end it (it would wake into a world that went on) and redo the step among themselves."""
    d = draw("freeze", zero=range(4), rank=range(1, 4), step=range(2, STEPS + 1))
    run = tmp_path / "run"
    pids, codes, out, err = by_hand(4, [*COMMON, "-z", d["zero"], "-i", shakespeare, "--out", run],
                                    f"stop:rank={d['rank']}:step={d['step']}", tmp_path)
    assert codes == {r: -signal.SIGKILL if r == d["rank"] else 0 for r in range(4)}, err[-5000:]
    assert "fault injected: SIGSTOP" in err
    assert f"live recovery at step {d['step']}: rank {d['rank']} lost (no heartbeat for" in out, out
    check_went_on(run, ref, pids, lost=d["rank"], step=d["step"], zero=d["zero"])


def test_a_lean_state_is_recovered_the_same_way(tmp_path, shakespeare):
    """A bf16 run at ZeRO 1-3 keeps a lean state (parallel/buckets.py): the blocks' matrices in bf16,
    their fp32 masters sharded. A rank killed in a step: its master shard comes from its buddy's copy
    with its m and v, the bf16 weights are rounded from the re-sharded masters, and the run ends with
    the weights of one process that lost nothing (whose buckets are fp32 under autocast: the same bits)."""
    d = draw("lean", zero=range(1, 4), rank=range(1, 4), step=range(2, STEPS + 1))
    ref, run = tmp_path / "ref", tmp_path / "run"
    braidtrain("train", *COMMON, "--dtype", "bf16", "-i", shakespeare, "--out", ref)
    pids, codes, out, err = by_hand(4, [*COMMON, "--dtype", "bf16", "-z", d["zero"], "-i", shakespeare, "--out", run],
                                    f"kill:rank={d['rank']}:step={d['step']}", tmp_path)
    assert codes == {r: -signal.SIGKILL if r == d["rank"] else 0 for r in range(4)}, err[-5000:]
    check_went_on(run, ref, pids, lost=d["rank"], step=d["step"], zero=d["zero"])


def test_a_second_loss_is_recovered_the_same_way(tmp_path, shakespeare, ref):
    """A rank killed at step 3, then another frozen at step 6: 4 -> 3 -> 2 ranks, the orphaned slots'
    micro-batches divided among the two left (ZeRO 1-3: the state re-sharded twice), the
    uninterrupted run's weights."""
    d = draw("second", zero=range(4), ranks=[(1, 2), (1, 3), (2, 1), (2, 3), (3, 1), (3, 2)])
    (a, b), run = d["ranks"], tmp_path / "run"
    faults = {a: f"kill:rank={a}:step=3", b: f"stop:rank={b}:step=6"}
    pids, codes, out, err = by_hand(4, [*COMMON, "-z", d["zero"], "-i", shakespeare, "--out", run], faults, tmp_path)
    assert codes == {r: -signal.SIGKILL if r in (a, b) else 0 for r in range(4)}, err[-5000:]
    first, second = membership(run)
    left = [r for r in range(4) if r not in (a, b)]
    assert (first["step"], first["members"], second["step"], second["members"]) == \
        (3, [r for r in range(4) if r != a], 6, left)
    assert {int(r): p for r, p in second["pids"].items()} == {r: pids[r] for r in left}
    recs = metrics(run)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert [r.get("world_size") for r in recs if "recover_s" in r] == [3, 2]
    assert summary(run)["weights_sha256"] == summary(ref)["weights_sha256"]


def test_a_step_already_applied_is_not_applied_twice(tmp_path, shakespeare, ref):
    """Rank 3 killed at step 4 after it applied the step's update, and rank 1's wait failed just
    before it applied it: ranks 0 and 2 applied it and fail in the step's next collective (ZeRO-1/2:
    the parameters' all-gather; else the loss's). Rank 1 applies the update with the clip scale and
    skip flag they report, step 4 is not done again -- logged without its loss -- and the weights are
    still the uninterrupted run's (ZeRO 1-3: rank 2's copy of rank 3's shard had that update too).
    Before it, at step 2, rank 2 judged rank 3 lost although it beats (as a stall just over the
    heartbeat's timeout makes a verdict that proves false): every member says it is here, so the four
    make their world again and do step 2 again -- no restart, no rank lost. And after the last step, in
    the final save, rank 0 judges rank 1 lost the same way: the three make their world again and save,
    validate and hash again -- a finished run is not turned into a restart."""
    d = draw("late", zero=range(4))
    run = tmp_path / "run"
    faults = {3: "kill-late:rank=3:step=4", 1: "fail-update:rank=1:step=4", 2: "misjudge:rank=2:step=2",
              0: f"misjudge:rank=0:step={STEPS + 1}"}
    pids, codes, out, err = by_hand(4, [*COMMON, "-z", d["zero"], "-i", shakespeare, "--out", run], faults, tmp_path)
    assert codes == {0: 0, 1: 0, 2: 0, 3: -signal.SIGKILL}, err[-5000:]
    assert "a lost peer's error before the update at step 4" in err, err[-3000:]
    # (which verdict a decision names -- the hook's, or a real stall's of a loaded machine at that moment,
    # as a round once had: "rank 1 sent no heartbeat for 3.4 s" -- is timing: that no rank was lost is not)
    assert re.search(r"live recovery at step 2: no rank lost \(rank \d sent no heartbeat for", out), out
    assert "live recovery at step 4: rank 3 lost" in out and "step 4 already applied" in out, out
    assert re.search(rf"live recovery at step {STEPS}: no rank lost \(rank \d sent no heartbeat for", out) and \
        "(the last: the final save and validation done again)" in out, out
    # The hooks' changes; a real stall's rebuild elsewhere (no rank lost) may come beside them.
    lost, = membership(run)
    rebuilt = {c["step"]: c for c in membership(run, rebuilt=True) if not c["lost"]}
    assert (lost["step"], list(lost["lost"])) == (4, ["3"]), lost
    assert (rebuilt[2]["members"], rebuilt[STEPS]["members"]) == ([0, 1, 2, 3], [0, 1, 2]), rebuilt
    assert {int(r): p for r, p in rebuilt[2]["pids"].items()} == {r: pids[r] for r in range(4)}
    recs, want = metrics(run), metrics(ref)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1)) and recs[3]["lost_in_flight"]
    assert 2 in [r["step"] for r in recs if "rebuilt_s" in r] and [r["step"] for r in recs if "recover_s" in r] == [4]
    assert [r["loss"] for i, r in enumerate(recs) if i != 3] == [r["loss"] for i, r in enumerate(want) if i != 3]
    assert summary(run)["weights_sha256"] == summary(ref)["weights_sha256"]


def test_a_verdict_after_the_final_collective_finds_the_run_complete(tmp_path, shakespeare, ref):
    """2 ranks. At a step drawn, rank 0 judges rank 1 lost although it beats: the two make their world
    again -- and doctor says that no rank was lost and where each gave up, not that one stopped or
    that they deadlocked. After the run's final collective, once rank 0 has written the summary, rank 1
    judges rank 0 lost the same way before it leaves the final part (as a verdict in the moment before
    it saw the last collective complete): its recovery finds the run complete (rank 0's mark, read
    while rank 0 still serves the store), and both exit 0 -- not a fallback to a restart (exit 75) of a
    run that is done -- with the uninterrupted run's losses, summary and weights."""
    d = draw("complete", zero=range(4), step=range(2, STEPS + 1))
    run = tmp_path / "run"
    faults = {0: f"misjudge:rank=0:step={d['step']}", 1: f"misjudge:rank=1:step={STEPS + 2}"}
    pids, codes, out, err = by_hand(2, [*COMMON, "-z", d["zero"], "-i", shakespeare, "--out", run], faults, tmp_path)
    assert codes == {0: 0, 1: 0}, err[-5000:]
    assert "braidtrain: rank 1: the run was complete when this rank gave up its wait (rank 0 sent no heartbeat" in \
        err, err[-3000:]
    assert f"live recovery at step {d['step']}: no rank lost (rank 1 sent no heartbeat for 3.0 s" in out, out
    assert membership(run) == [] and d["step"] in [c["step"] for c in membership(run, rebuilt=True)]
    recs = metrics(run)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in recs] == [r["loss"] for r in metrics(ref)]
    assert summary(run)["step"] == STEPS and summary(run)["weights_sha256"] == summary(ref)["weights_sha256"]
    assert (run / "checkpoints" / f"step_{STEPS:08d}").is_dir()
    report = braidtrain("doctor", run).stdout
    assert changed(report, d["step"], "no rank lost"), report
    assert "no rank was lost: a heartbeat verdict proved false (every member said it is here), so the members gave " \
           "up where they were -- " in report, report
    assert "deadlock" not in report and "stopped" not in report, report


def test_a_joiner_takes_the_lost_ranks_place(tmp_path, shakespeare, ref):
    """Rank 2 killed at step 3 while a fifth process asks to join in its place, at ZeRO 1-3: the
    three others redo step 3, admit it two steps later (step 6), re-shard the state over the four
    (the joiner's shard and copy included; every member's sha256 of it compared) and go on as four
    -- ending, like the others, with the uninterrupted run's weights. A joiner with other flags
    (--seed) is refused in one line before it asks."""
    d = draw("join", zero=range(1, 4))
    run = tmp_path / "run"
    pids, codes, out, err = by_hand(4, [*COMMON, "-z", d["zero"], "-i", shakespeare, "--out", run], "kill:rank=2:step=3",
                                    tmp_path, join=2, bad=["--seed", "7"])
    assert codes == {0: 0, 1: 0, 2: -signal.SIGKILL, 3: 0, "join": 0, "bad": 2}, err[-5000:] + out[-3000:]
    assert "--join with flags other than the job's: seed 7 (the job's: 1337); give it the job's flags" in err, err[-3000:]
    assert "rank 2: joined at step 6, the state re-sharded from the members (sha256" in err and "checked)" in err, \
        err[-3000:]
    assert "live: rank 2 joined (pid" in out and f"the ZeRO-{d['zero']} state re-sharded over 4 ranks" in out, out
    check_went_on(run, ref, pids, lost=2, step=3, zero=d["zero"], joined=6)
    assert (run / "checkpoints" / f"step_{STEPS:08d}" / "rank_00002.safetensors").is_file()  # the joiner's part
    assert changed(braidtrain("doctor", run).stdout, 6, "rank 2 joined")


def test_plan_counts_the_copies_and_refuses_expert_parallelism():
    """`plan --live-recovery`: layouts of two replicas or more, each ZeRO 1-3 rank with its
    neighbour's shard counted -- at ZeRO-3 its sharded state twice (m, v, the gradient and the
    parameters) -- against the planner's estimate of the same layout without; --ep is one line."""
    from braidtrain.model import registry
    from braidtrain.plan.estimate import estimate
    from braidtrain.plan.memory import GB, param_counts
    from braidtrain.plan.space import Candidate, Setup

    p = braidtrain("plan", "--model", "tiny", "--gpus", 4, "-t", 64, "-d", D, "--variants", "--json", "--live-recovery")
    rows = json.loads(p.stdout)["layouts"]
    assert all(r["dp"] >= 2 and r["ep"] == 1 for r in rows) and any(r["tp"] * r["pp"] * r["cp"] > 1 for r in rows)
    live = [r for r in rows if r["dp"] == 4]
    assert {r["zero"] for r in live} == {0, 1, 2, 3}
    s = Setup(registry.model_config("tiny", 50257), 4, 80.0, 64, D)
    counts = param_counts(s.cfg)
    P, M = counts["rank"], counts["matrices"]  # (ZeRO 1-3 on a GPU: a lean state, the matrices' masters apart)
    for r in live:
        zero, lay = r["zero"], Candidate(4, r["zero"], r["b"], r["recompute"])
        without, mine = (estimate(replace(s, live=v), lay) for v in (False, True))
        # the copy: the neighbour's m, v and master shards, the gradient it receives, and at ZeRO-3 the
        # neighbour's fp32 parameters (the bf16 matrices' shard: their master, counted above)
        extra = {"params": 4 * (P - M) // 4 * (zero == 3), "grads": 4 * P // 4 * (zero >= 1),
                 "optimizer": (8 * P + 4 * M) // 4 * (zero >= 1)}
        assert all(mine["state"][k] - without["state"][k] == extra[k] for k in extra), (r, mine["state"])
        assert all(r["mem_gb"][k] == pytest.approx(mine["mem"][k] / GB, rel=1e-9) for k in extra), (r, mine["mem"])
    p = braidtrain("plan", "--model", "tiny", "--gpus", 4, "--live-recovery", "--ep", 2, check=False)
    assert p.returncode == 2 and p.stderr.startswith(
        "braidtrain: error: --live-recovery does not recover expert parallelism, got --ep 2"), p.stderr


def test_the_redone_steps_tree_is_exact_modes():
    """However the micro-batches of a step fall on ranks, each rank's complete subtrees (LiveTree)
    folded together give TreeSum's root over them all, bit for bit -- and not when one leaf is
    taken twice or the tree is not the one of the uninterrupted run."""
    from braidtrain.parallel.slots import LiveTree, fold, forest
    from braidtrain.parallel.exact import TreeSum

    class Pool:  # the engine's buffer pool, as LiveTree and TreeSum use it
        def recycle(self, buf):
            pass

        def take(self, n):
            return torch.empty(n)

    rnd, n = random.Random(0), 16
    leaves = [torch.randn(1000) * 10 ** rnd.uniform(-3, 3) for _ in range(n)]
    whole = TreeSum(lambda b: None)
    for i in rnd.sample(range(n), n):
        whole.add(i, leaves[i].clone())
    want = whole.total(n)
    for trial in range(20):
        cuts = sorted(rnd.sample(range(1, n), rnd.randrange(1, 5)))
        order = list(range(n)) if trial % 2 else rnd.sample(range(n), n)
        shares = [order[a:b] for a, b in zip([0, *cuts], [*cuts, n])]
        pieces, pending = {}, {}
        for share in shares:
            tree = LiveTree(Pool(), share, pending)
            for k in rnd.sample(range(len(share)), len(share)):
                tree.add(k, leaves[share[k]].clone())
            root = tree.total(len(share))
            nodes = pending.pop(id(root))
            assert sorted(nodes) == forest(share)
            pieces.update(nodes)
        got = fold(pieces, n)
        assert torch.equal(got, want), (trial, shares)
    flat = leaves[0].clone()
    for x in leaves[1:]:
        flat += x  # the sum in arrival order: another tree, other bits
    assert not torch.equal(flat, want)


@pytest.mark.parametrize("flags, words", [
    (["--moe-experts", "2", "--ep", "2"], "--live-recovery does not recover expert parallelism, got --ep 2: an ep "
                                          "group spans 2 replicas"),
    (["--join", "--tp", "2"], "--join replaces one data-parallel rank, and with --tp 2 a lost rank retires"),
    (["--heartbeat-timeout", "0"], "--live-recovery finds frozen ranks by the heartbeat"),
    (["--join"], "--join replaces a lost rank of a running job: give -pi tcp"),
    (["--join", "--no-live"], "--join adds a process to a job that runs with --live-recovery: give both"),
])
def test_layouts_live_recovery_cannot_keep_are_refused(tmp_path, shakespeare, flags, words):
    live = [] if "--no-live" in flags else ["--live-recovery"]
    flags = [f for f in flags if f != "--no-live"]
    p = braidtrain("train", *SMALL, "-i", shakespeare, "-x", 1, "--out", tmp_path / "r", *live, *flags, check=False)
    assert p.returncode == 2 and words in p.stderr, p.stderr[-2000:]
    assert len([line for line in p.stderr.splitlines() if line.strip()]) == 1, p.stderr


def test_a_rank_lost_with_its_buddy_falls_back_in_one_line(tmp_path, shakespeare):
    """ZeRO 1-3: ranks r-1 and r killed in the same step -- r-1 held the one copy of r's shard --
    leave a shard nobody holds: the survivors say so in one line each and exit 75 (the checkpoint
    restart path), and the membership log and doctor say it too. (Without --exact: the steps before
    show each rank's memory, which the planner must count with the copy, to 1%.)"""
    from braidtrain.plan.estimate import estimate
    from braidtrain.plan.space import Candidate, Setup
    from braidtrain.model import registry

    d = draw("buddy", zero=range(1, 4), rank=(2, 3))
    r, run = d["rank"], tmp_path / "run"
    flags = [f for f in COMMON if f != "--exact"]
    pids, codes, out, err = by_hand(4, [*flags, "-z", d["zero"], "-i", shakespeare, "--out", run],
                                    {r - 1: f"kill:rank={r - 1}:step=3", r: f"kill:rank={r}:step=3"}, tmp_path)
    assert codes == {k: -signal.SIGKILL if k in (r - 1, r) else 75 for k in range(4)}, err[-5000:]
    line = (f"peer lost: ranks {r - 1},{r} lost: rank {r}'s shard of the sharded optimizer state had its one copy on "
            f"rank {r - 1}, lost with it; falling back to the checkpoint restart")
    said = [x for x in err.splitlines() if line in x]
    assert len(said) == 2 and all(x.startswith("braidtrain: rank ") for x in said), err[-3000:]
    (change,) = membership(run)
    assert change["fallback"] and change["step"] == 3 and f"rank {r - 1}, lost with it" in change["what"]
    assert changed(braidtrain("doctor", run).stdout, 3, f"ranks {r - 1},{r} lost; rank {r}'s shard")
    cfg = registry.model_config("tiny", 256, n_layer=2, n_embd=64, n_head=2)
    s = Setup(cfg, 4, 80, 64, D, cpu=True, live=True, bucket_mb=COMMON[COMMON.index("--bucket-mb") + 1])
    state = estimate(s, Candidate(4, d["zero"], 2, False))["state"]
    want = (state["params"] + state["grads"] + state["optimizer"] - state["transient"]) / 1e9
    assert metrics(run)[0]["mem_gb"] == pytest.approx(want, rel=0.01)


def check_retired(run: Path, ref: Path, pids: dict, codes: dict, err: str, lost: int, step: int, partner: int) -> None:
    """4 ranks, 2 replicas: `lost` (of replica 1) lost at `step`; its partner left in one line (exit 0),
    the other replica's ranks -- the processes that started -- logged every step once and ended with
    the uninterrupted run's losses and weights; the membership log and doctor name the retired replica."""
    left = [r for r in range(4) if r not in (lost, partner)]
    assert codes == {r: -signal.SIGKILL if r == lost else 0 for r in range(4)}, err[-5000:]
    line = (f"braidtrain: rank {partner}: its replica (data-parallel index 1) was retired because rank {lost} was "
            f"lost; ranks {','.join(map(str, left))} go on without it; exiting")
    assert [x for x in err.splitlines() if f"rank {partner}: " in x and "fault" not in x] == [line], err[-3000:]
    recs, want = metrics(run), metrics(ref)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in recs] == [r["loss"] for r in want]
    assert [(r["step"], r["world_size"]) for r in recs if "recover_s" in r] == [(step, 2)]
    (change,) = membership(run)
    assert (change["step"], change["members"], list(change["lost"]), change["retired"], change["left"]) == \
        (step, left, [str(lost)], [1], [partner])
    assert {int(r): p for r, p in change["pids"].items()} == {r: pids[r] for r in left}
    assert summary(run)["weights_sha256"] == summary(ref)["weights_sha256"]
    report = braidtrain("doctor", run).stdout
    assert changed(report, step, f"rank {lost} lost"), report
    assert f"replica 1 retired (rank {partner} leaves); ranks {','.join(map(str, left))} go on, world 4 -> 2 " \
           f"(dp 2 -> 1)" in report, report


def test_a_lost_pipeline_rank_retires_its_replica(tmp_path, shakespeare, ref):
    """dp 2 x pp 2: a rank of replica 1 (ranks 1, 3) killed in a step. Its stage is nowhere else, so
    the replica is retired: its other stage leaves in one line, and replica 0 (ranks 0, 2) does the
    step again with all the micro-batches -- its pipeline's transfers abandonable all-to-alls -- and
    ends with the weights of the one-process run (exact mode's bits do not depend on dp or pp)."""
    d = draw("pp", rank=(1, 3), step=range(2, STEPS + 1))
    run = tmp_path / "run"
    pids, codes, out, err = by_hand(4, [*COMMON, "--pp", 2, "-i", shakespeare, "--out", run],
                                    f"kill:rank={d['rank']}:step={d['step']}", tmp_path)
    assert f"live recovery at step {d['step']}: rank {d['rank']} lost (its process" in out, out[-3000:] + err[-3000:]
    check_retired(run, ref, pids, codes, err, d["rank"], d["step"], partner=4 - d["rank"])


def test_a_frozen_tensor_parallel_rank_retires_its_replica(tmp_path, shakespeare):
    """dp 2 x tp 2: a rank of replica 1 (ranks 2, 3) frozen in a step, found by the heartbeat; its tp
    partner leaves in one line, replica 0 goes on as dp 1 x tp 2 (its tp group made again over the
    new world, the model's layers holding the same Group) and ends with a tp-2 run's weights. (-b 8:
    a quarter of the micro-batches, each a tp collective per layer -- which cost most here.)"""
    d = draw("tp", rank=(2, 3), step=range(2, STEPS + 1))
    tp_ref, run, args = tmp_path / "ref", tmp_path / "run", [*COMMON, "-b", 8, "--tp", 2, "-i", shakespeare]
    braidtrain("train", *args, "--out", tp_ref, nproc=2)
    pids, codes, out, err = by_hand(4, [*args, "--out", run], f"stop:rank={d['rank']}:step={d['step']}", tmp_path)
    assert f"live recovery at step {d['step']}: rank {d['rank']} lost (no heartbeat for" in out, out[-3000:]
    check_retired(run, tp_ref, pids, codes, err, d["rank"], d["step"], partner=5 - d["rank"])


def test_a_loss_in_rank_0s_replica_falls_back_in_one_line(tmp_path, shakespeare):
    """dp 2 x tp 2, rank 1 killed: its replica holds rank 0, whose process hosts the store and cannot
    leave -- the ranks left fall back to the restart path (exit 75) together, each in one line."""
    run = tmp_path / "run"
    pids, codes, out, err = by_hand(4, [*SMALL, "-d", D, "-x", 3, "--tp", 2, "--heartbeat-timeout", 3, "-i",
                                        shakespeare, "--out", run], "kill:rank=1:step=2", tmp_path)
    assert codes == {0: 75, 1: -signal.SIGKILL, 2: 75, 3: 75}, err[-5000:]
    line = ("peer lost: rank 1 lost: it retires replica 0, and its rank 0, which hosts the rendezvous store, cannot "
            "leave; falling back to the checkpoint restart")
    assert sorted(x.split(":")[1] for x in err.splitlines() if line in x) == [" rank 0", " rank 2", " rank 3"], err
    (change,) = membership(run)
    assert change["fallback"] and change["step"] == 2
    assert changed(braidtrain("doctor", run).stdout, 2, "rank 1 lost; it retires replica 0")
