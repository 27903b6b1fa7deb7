"""Interruptions lose nothing (#56): SIGTERM and SIGINT stop a run at a step boundary with a
checkpoint of its last completed step, and --resume auto ends bitwise where an uninterrupted run
ends; a second signal, or a budget run out, stops at once. Resumes tell the truth, a failed start
leaves nothing that blocks the corrected command, a metrics line cut short is tolerated, the final
save failing fails the run, and a disk too small for the checkpoints is said at the start.

The ranks are forked by tests/forkserver.py (helpers._start) so that a test can signal each one,
as a scheduler does. (torchrun, which forwards SIGTERM and SIGINT to its workers, is checked by hand:
its start takes most of a minute on a loaded 2-core machine; docs/fault-tolerance.md.)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import ROOT, SMALL, _start, braidtrain, env, hold_port, metrics, summary

X = 8
COMMON = [*SMALL, "-d", 512, "-x", X, "--exact"]


class Ranks:
    """`braidtrain train ARGS` as nproc forked ranks (as under torchrun: RANK, WORLD_SIZE, ...),
    each one a process of its own that the test can signal."""

    def __init__(self, nproc: int, *args, environ: dict | None = None):
        self.tmp = tempfile.mkdtemp(prefix="braidtrain-preempt-")
        self.out, self.err = os.path.join(self.tmp, "out"), os.path.join(self.tmp, "err")
        open(self.out, "w").close(), open(self.err, "w").close()
        base = dict(environ or env())
        self.held = hold_port()  # closed in wait()
        if nproc > 1:
            base.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(self.held.getsockname()[1]))
        target = ["-m", "braidtrain", "train", *map(str, args)]
        self.ranks = [_start(dict(target=target, cwd=str(ROOT), out=self.out, err=self.err, fsize=None,
                                  env=dict(base, **({"RANK": str(r), "LOCAL_RANK": str(r)} if nproc > 1 else {}))))
                      for r in range(nproc)]
        self.pids = [pid for _, _, pid in self.ranks]

    def signal(self, sig, ranks=None) -> None:
        for r in ranks if ranks is not None else range(len(self.pids)):
            try:
                os.kill(self.pids[r], sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float = 120) -> tuple[list[int], str, str]:
        """Every rank's exit code (negative: the signal that ended it), stdout and stderr."""
        codes = []
        for conn, f, pid in self.ranks:
            conn.settimeout(timeout)
            try:
                codes.append(int(f.readline() or -9))
            except OSError:
                os.kill(pid, signal.SIGKILL)
                codes.append(int(f.readline() or -9))
            f.close()
            conn.close()
        self.held.close()
        out, err = Path(self.out).read_text(), Path(self.err).read_text()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return codes, out, err


def steps_done(run: Path) -> int:
    m = run / "metrics.jsonl"
    return len(m.read_text().splitlines()) if m.is_file() else 0


def wait_for_steps(run: Path, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while steps_done(run) < n:
        assert time.monotonic() < deadline, f"{run}: no step {n} within {timeout} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def ref(tmp_path_factory, shakespeare) -> Path:
    """The uninterrupted run every stopped and resumed run must end as, bit for bit (exact mode is
    bitwise across dp and ZeRO stages)."""
    out = tmp_path_factory.mktemp("preempt") / "ref"
    braidtrain("train", *COMMON, "-i", shakespeare, "--out", out)
    return out


def assert_stopped_and_resumes(run: Path, ref: Path, codes, err, sig, nproc: int, zero: int, data,
                               cut: bool = False) -> int:
    """The stopped run: every rank exited 128 + sig; one checkpoint, of its last completed step; then
    --resume auto ends with the uninterrupted run's weights and losses (`cut`: metrics.jsonl ending
    in half a line first, which the resume leaves out and says so). Returns that step."""
    assert codes == [128 + sig] * len(codes), (codes, err[-3000:])
    done = [r["step"] for r in metrics(run)][-1]
    assert f"stopped after step {done} of {X}: saved" in err, err[-3000:]
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == [f"step_{done:08d}"], err[-3000:]
    if cut:
        with open(run / "metrics.jsonl", "a") as f:
            f.write('{"step": 99, "loss": 1.2')
    p = braidtrain("train", *COMMON, "-i", data, "-z", zero, "--out", run, "--resume", "auto", nproc=nproc)
    assert f"resumed from {run / 'checkpoints' / f'step_{done:08d}'} (step {done})" in p.stdout, p.stdout
    assert ("its last line" in p.stdout and "is cut short" in p.stdout) == cut, p.stdout
    assert summary(run)["weights_sha256"] == summary(ref)["weights_sha256"]
    assert [(r["step"], r["loss"]) for r in metrics(run)] == [(r["step"], r["loss"]) for r in metrics(ref)]
    return done


PICK = random.Random(56)  # the step after which each case is signalled: drawn once, the same every session
CASES = [(1, 0, signal.SIGINT, None), (2, 1, signal.SIGTERM, [1]), (4, 3, signal.SIGINT, [0, 2])]


@pytest.mark.parametrize("nproc, zero, sig, who", CASES, ids=[f"{n}ranks-zero{z}-{s.name}" for n, z, s, _ in CASES])
def test_a_signal_stops_at_a_step_boundary_and_the_resume_is_bitwise(tmp_path, shakespeare, ref, nproc, zero, sig,
                                                                     who):
    """Signalled after a drawn step -- every rank, or some of them only (the others learn it at the
    step boundary's all-reduce) -- the group finishes the step in progress, saves it, exits 128 +
    signal; the resume ends bitwise as the uninterrupted run."""
    run = tmp_path / "run"
    ranks = Ranks(nproc, *COMMON, "-i", shakespeare, "-z", zero, "--out", run)
    wait_for_steps(run, PICK.randint(1, X - 3))
    ranks.signal(sig, who)
    codes, _, err = ranks.wait()
    assert_stopped_and_resumes(run, ref, codes, err, sig, nproc, zero, shakespeare)


def test_slurm_sigterm_then_sigkill_inside_the_grace_loses_no_step(tmp_path, shakespeare, ref):
    """As Slurm's scancel or a preemption: SIGTERM to every process (torchrun's agent and its
    workers alike), SIGKILL to what is left after the grace (KillWait). Every rank has left by
    itself before the SIGKILL, and the checkpoint is of the last step the run logged. A metrics
    line cut short (the disk filled as it was written) is left out, and said, on the resume."""
    run, grace = tmp_path / "run", 20.0
    ranks = Ranks(2, *COMMON, "-i", shakespeare, "-z", 2, "--out", run, "--preempt-budget", grace - 5)
    wait_for_steps(run, PICK.randint(1, X - 3))
    ranks.signal(signal.SIGTERM)
    killer = threading.Timer(grace, ranks.signal, (signal.SIGKILL,))
    killer.start()
    try:
        codes, _, err = ranks.wait()
    finally:
        killer.cancel()
    done = assert_stopped_and_resumes(run, ref, codes, err, signal.SIGTERM, 2, 2, shakespeare, cut=True)
    assert done >= 2


def test_a_save_that_cannot_fit_the_budget_is_not_begun(tmp_path, shakespeare):
    """The step-2 save sleeps 4 s (the test hook); signalled later with --preempt-budget 3, the run
    does not begin a save it cannot finish: it says so, and step 2's stays the newest. (Signalled
    as soon as step 2's checkpoint is in place, so during step 3: a signal that came while step 4's
    own --ckpt-every save was already under way would see that save finish, rightly.)"""
    run = tmp_path / "run"
    ranks = Ranks(1, *COMMON, "-i", shakespeare, "--out", run, "--ckpt-every", 2, "--preempt-budget", 3,
                  environ=dict(env(), BRAIDTRAIN_FAULT="slow-save:step=2:seconds=4"))
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / "step_00000002").is_dir():
        assert time.monotonic() < deadline, "no step-2 checkpoint within 120 s"
        time.sleep(0.01)
    ranks.signal(signal.SIGTERM)
    codes, _, err = ranks.wait()
    assert codes == [128 + signal.SIGTERM], err[-3000:]
    assert "not saved: the last save took 4." in err and f"the newest checkpoint is {run}/checkpoints/step_00000002" in err
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000002"]


def test_a_second_signal_or_the_budget_stops_at_once(tmp_path, shakespeare):
    """A save that sleeps (the test hook) holds the stop: a second SIGTERM ends the run at once;
    with no second signal, --preempt-budget does. Both say so in one line; the half-written save
    is never read, and the step-2 checkpoint stays the newest."""
    for case in ("second", "budget"):
        run = tmp_path / case
        e = dict(env(), BRAIDTRAIN_FAULT="slow-save:step=4:seconds=60")
        ranks = Ranks(1, *COMMON, "-i", shakespeare, "--out", run, "--ckpt-every", 2, "--preempt-budget", 3,
                      environ=e)
        wait_for_steps(run, 3)
        deadline = time.monotonic() + 60
        while not list((run / "checkpoints").glob("step_00000004.tmp")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ranks.signal(signal.SIGTERM)
        if case == "second":
            time.sleep(1.5)  # (a repeat within a second is the same request delivered twice)
            ranks.signal(signal.SIGTERM)
        codes, _, err = ranks.wait()
        assert codes == [128 + signal.SIGTERM], err[-3000:]
        why = "a second one: stopped at once" if case == "second" else "--preempt-budget 3 s ran out while saving step 4"
        assert f"braidtrain: rank 0: signal SIGTERM ({why})" in err or f"signal SIGTERM: {why}" in err, err[-3000:]
        from braidtrain.io import checkpoint

        assert checkpoint.latest(run).name == "step_00000002"


def test_resume_tells_the_truth(tmp_path, shakespeare, ref):
    """A resume past -x refuses in one line (it would save step-8 weights as step 4); --resume auto
    with no checkpoint says it starts from step 0."""
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    p = braidtrain("train", *COMMON, "-i", shakespeare, "--out", run, "--resume", "auto", "-x", 4, check=False)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr
    assert "holds step 8, past this run's -x 4: give a larger -x" in p.stderr
    fresh = tmp_path / "fresh"
    p = braidtrain("train", *SMALL, "-d", 512, "-x", 1, "-i", shakespeare, "--out", fresh, "--resume", "auto",
                   "--no-save")
    assert f"no checkpoint in {fresh / 'checkpoints'}: starting from step 0" in p.stdout, p.stdout
    assert not (fresh / "checkpoints").exists()  # --no-save: the final checkpoint neither


def test_a_failed_start_leaves_nothing_that_blocks_the_corrected_command(tmp_path, shakespeare):
    """A run that fails at its start (a truncated .bin: found before --out is claimed since the
    input sweep, tests/test_inputs.py; a run that claimed it leaves only run.json): the corrected
    command, into the same --out and without --resume, is not refused as another run's."""
    bad = tmp_path / "bad"
    shutil.copytree(shakespeare, bad)
    train = next(bad.glob("*train*.bin"))
    train.write_bytes(train.read_bytes()[:4096])
    run = tmp_path / "run"
    p = braidtrain("train", *SMALL, "-d", 512, "-x", 1, "-i", bad, "--out", run, check=False)
    assert p.returncode == 2 and "truncated" in p.stderr, p.stderr
    assert not run.exists() or {f.name for f in run.iterdir()} <= {"run.json", "config.toml", "flight"}, list(run.iterdir())
    braidtrain("train", *SMALL, "-d", 512, "-x", 1, "-i", shakespeare, "--out", run, "--no-save")


def test_the_final_save_failing_fails_the_run(tmp_path, shakespeare):
    """Under a 1 MB file-size limit every save fails: with --on-save-error continue the run goes on
    past the step-2 save, but its final save failing ends it with exit 2, its line saying there is
    no earlier checkpoint (not "the previous checkpoint is intact"), and no .tmp folder is left."""
    run = tmp_path / "run"
    p = braidtrain("train", *SMALL, "-d", 512, "-x", 4, "-i", shakespeare, "--out", run, "--ckpt-every", 2,
                   "--on-save-error", "continue", fsize=1 << 20, check=False)
    errors = [line for line in p.stderr.splitlines() if line.startswith("braidtrain: error:")]
    assert p.returncode == 2 and len(errors) == 1, p.stderr[-3000:]
    assert "training goes on" in p.stdout and "step_00000002" in p.stdout
    assert "step_00000004" in errors[0] and "final checkpoint" in errors[0] and "no earlier checkpoint" in errors[0]
    assert "intact" not in errors[0]
    assert list((run / "checkpoints").iterdir()) == []


def test_plot_and_metrics_tolerate_a_last_line_cut_short(tmp_path, capsys):
    from braidtrain.cli import main
    from braidtrain.io.metrics import read_metrics

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n{"step": 3, "lo')
    assert main(["plot", str(run), "--out", str(tmp_path / "loss.png")]) == 0
    err = capsys.readouterr().err
    assert "metrics.jsonl: its last line (3) is cut short" in err and (tmp_path / "loss.png").is_file()
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    (run / "metrics.jsonl").write_text('{"step": 1, "lo\n{"step": 2, "loss": 2.5}\n')
    assert main(["plot", str(run), "--out", str(tmp_path / "loss.png")]) == 2
    assert "line 1 is not a JSON record" in capsys.readouterr().err


def test_a_disk_too_small_for_the_checkpoints_is_said_at_the_start(tmp_path, monkeypatch):
    """One line with the size, the free space and what to do; none when they fit. Kept at once: a
    run's --keep-ckpts checkpoints, and one more while a save replaces the oldest."""
    from braidtrain import build
    from braidtrain.io import rundir

    said = []
    free = {"bytes": 10**9}
    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda _p: SimpleNamespace(free=free["bytes"]))
    cfg = SimpleNamespace(ckpt_every=10, max_steps=100, keep_ckpts=2)
    run = SimpleNamespace(cfg=cfg, out=tmp_path, run_id="x", start_step=0, mcfg=SimpleNamespace(num_params=lambda: 10**8),
                          rt=SimpleNamespace(log=said.append))
    build.check_space(run)  # 3 x 1.2 GB against 1 GB free
    assert said == [f"warning: the checkpoints this run keeps need 3.6 GB under {tmp_path} (3 x 1.2 GB; --keep-ckpts "
                    "2) and 1.0 GB are free: the save would fail then; free space, give --out on a larger disk, lower "
                    "--keep-ckpts, or --no-save"]
    free["bytes"] = 4 * 10**9
    build.check_space(run)
    cfg.ckpt_every, free["bytes"] = 0, 2 * 10**9  # the final checkpoint alone
    build.check_space(run)
    assert len(said) == 1


def test_a_null_text_field_is_named_as_null(tmp_path):
    from braidtrain.errors import UserError
    from braidtrain.io.corpus import documents

    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"text": "hello"}) + "\n" + json.dumps({"text": None, "id": 2}) + "\n")
    with pytest.raises(UserError, match=r"c.jsonl line 2: its text field 'text' is null: give every record text"):
        list(documents([f]))
