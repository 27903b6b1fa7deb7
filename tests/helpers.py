"""Run the real command line, in one process or under torchrun, and read what a run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A model small enough that an 8-rank run on two cores takes seconds.
SMALL = ["--model", "tiny", "--n-layer", "2", "--n-embd", "64", "--n-head", "2", "-t", "64", "-b", "2",
         "--val-every", "0", "--sample-tokens", "0", "--no-progress"]


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    e.pop("RANK", None)
    return e


def braidtrain(*args, nproc: int = 1, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, "-m", "braidtrain", *map(str, args)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "braidtrain", *map(str, args)]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def metrics(run: Path) -> list[dict]:
    return [json.loads(l) for l in (Path(run) / "metrics.jsonl").read_text().splitlines() if l.strip()]


def summary(run: Path) -> dict:
    return json.loads((Path(run) / "summary.json").read_text())


def prepare_bytes(out: Path) -> Path:
    braidtrain("data", "prepare", "--corpus", "shakespeare", "--tokenizer", "bytes", "--out", out)
    return out


def run_interpreted(script: str) -> dict:
    """Run a test file as a script under Triton's CPU interpreter (TRITON_INTERPRET=1 must be set
    before triton is first imported, and pytest shares one process between files): the JSON its
    last line prints. Skips where triton is not installed (`make test` installs it)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    p = subprocess.run([sys.executable, script], cwd=ROOT, env=dict(env(), TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-5000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


class Layouts:
    """tests/layouts_worker.py's suites of layouts, run one after another in one 8-rank process
    group, started in the background (conftest.py starts it before the first test); `results()`
    waits for it: suite -> its results."""

    def __init__(self, out: Path, suites: list[str]):
        self.out, self.suites = Path(out), suites
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8",
               str(ROOT / "tests" / "layouts_worker.py"), str(out), ",".join(suites)]
        self.log = open(self.out / "log.txt", "w+")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def results(self, timeout: float = 1800) -> dict:
        rc = self.proc.wait(timeout)
        self.log.seek(0)
        assert rc == 0, self.log.read()[-4000:]
        return {s: json.loads((self.out / f"results_{s}.json").read_text()) for s in self.suites}

    def stop(self) -> None:
        if self.proc.poll() is None:  # (torchrun ends its workers on SIGTERM)
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def assert_follows(runs: dict, names, ref: dict, rel: float, learns: float = 0.01) -> None:
    """Each named layout's loss and gradient norm at every step within `rel` of ref's, and its
    loss down by `learns` over the run (a layout that silently skipped updates would not be)."""
    for name in names:
        r = runs[name]
        for got, want in zip(r["losses"] + r["norms"], ref["losses"] + ref["norms"]):
            assert abs(got - want) <= rel * abs(want), (name, r["losses"], r["norms"], ref)
        assert r["losses"][-1] < r["losses"][0] - learns, name


def assert_bitwise(runs: dict, names, ref: dict) -> None:
    """Each named layout's final weights, every loss and every gradient norm: ref's, to the bit."""
    for name in names:
        r = runs[name]
        assert (r["sha"], r["losses"], r["norms"]) == (ref["sha"], ref["losses"], ref["norms"]), name
