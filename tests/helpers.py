"""Run the real command line, in one process or as a process group, and read what a run wrote.

`launch` has each process forked by tests/forkserver.py, which imported torch and braidtrain once:
a fresh interpreter spends ~1.5 s of CPU importing torch, and the suite starts some 200 processes
on a 2-core machine. A forked process runs the module or script as `python -m` / `python` would,
with its own argv, environment, folder and stdout and stderr. N ranks get what torchrun gives its
workers (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), and as under torchrun, the first rank
to fail has the others stopped. Tests of torchrun itself (its restarts, its agent's store) and of
a process's signals run the real thing: test_runtime, test_fault."""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A model small enough that an 8-rank run on two cores takes seconds.
SMALL = ["--model", "tiny", "--n-layer", "2", "--n-embd", "64", "--n-head", "2", "-t", "64", "-b", "2",
         "--val-every", "0", "--sample-tokens", "0", "--no-progress"]


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    e.pop("RANK", None)
    return e


# Exact mode's CPU bits depend on the kernels that torch's CPU dispatch, MKL and oneDNN pick for the
# processor: the same run gives other bits under AVX-512 and AVX2, on Intel and AMD (test_parity's
# exact run: 8c9e547f... on the CPU that first pinned it, d70d8f90... on an AMD EPYC). The pinned runs
# force kernels every x86-64 CPU runs alike -- ATen's baseline code path, MKL's conditional
# numerical reproducibility in its SSE2 branch, oneDNN at SSE4.1 -- so one pin per torch build holds
# on any such machine (docs/performance.md, "The suite"). The layouts' bitwise comparisons run on
# whatever kernels the machine picks.
PORTABLE_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}
# (torch build, machine) -> the pinned runs' weights_sha256: test_parity's exact run (dp) and
# test_tp's (tp2). A change that moves exact mode's bits must re-pin them on purpose and say so.
# (Re-pinned for #57: exact mode's AdamW became single IEEE operations (optim.exact_adamw), the same bits
# on the GPU and on the host, so that --offload optimizer keeps them; torch's fused kernel was not.
# Re-pinned again, wave 4's second session: its square root is now taken in float64 and rounded once,
# because torch's float32 sqrt on the CPU is not correctly rounded -- on this VM 826,183 of 4M values
# differ from numpy's (correctly rounded) sqrt, at ATEN_CPU_CAPABILITY=default too -- and CUDA's is:
# the GPU's exact bits stay, the host's now equal them; docs/performance.md, "Optimizer offload".)
EXACT_PINS = {
    ("2.13.0+cpu", "x86_64"): {"dp": "92946746bf3cd636051a2f46d60a0ea867c416795eef0e31acfee4340cbfd32a",
                               "tp2": "4f91c9cc16daef542169d13987d45c918ea6d1586d482fc4b2419b7b83a69623"},
}


def portable_env() -> dict:
    return dict(env(), **PORTABLE_KERNELS)


def check_pinned(which: str, sha: str) -> None:
    """sha (a run under portable_env) against its pin for this torch build and machine; where no
    pin exists (another torch, another architecture), a warning in pytest's summary says so."""
    import importlib.metadata
    import platform
    import warnings

    key = (importlib.metadata.version("torch"), platform.machine())
    pins = EXACT_PINS.get(key)
    if pins is None:
        warnings.warn(f"no pinned exact-mode hash for torch {key[0]} on {key[1]}: {which} gave {sha}, compared only "
                      f"across layouts (add it to tests/helpers.py's EXACT_PINS to guard it here)", stacklevel=2)
        return
    assert sha == pins[which], f"exact mode's bits moved ({which}: {sha}, pinned {pins[which]}): re-pin only on purpose"


_server: tuple | None = None  # (its process, its socket's path)
_lock = threading.Lock()  # (test_cli starts its commands from a few threads)


def _server_path() -> str:
    """The fork server's socket, the server started on first use (with OMP_NUM_THREADS=1: OpenMP
    reads it once, as torch loads)."""
    global _server
    with _lock:
        if _server is None:
            path = os.path.join(tempfile.mkdtemp(prefix="braidtrain-forks-"), "socket")
            proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "forkserver.py"), path], env=env(),
                                    stdout=subprocess.PIPE, text=True)
            assert proc.stdout.readline().strip() == "ready", "tests/forkserver.py did not start"
            atexit.register(proc.kill)
            _server = proc, path
    return _server[1]


def _start(req: dict) -> tuple:
    """Ask the server for one process: (the connection, its reader, the process id)."""
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(_server_path())
    conn.sendall((json.dumps(req) + "\n").encode())
    f = conn.makefile("r")
    return conn, f, int(f.readline())


def _signal(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)  # the process and what it started (forkserver.child: a session of its own)
    except ProcessLookupError:
        pass


def launch(*target, nproc: int = 1, cwd=ROOT, environ: dict | None = None, timeout: float = 300,
           fsize: int | None = None, cancel: threading.Event | None = None) -> subprocess.CompletedProcess:
    """Run `python -m MODULE ARGS` (target: "-m", MODULE, *ARGS) or `python SCRIPT ARGS` as nproc
    ranks; stdout and stderr: all ranks', one stream each. The return code: 0, or the first
    failed rank's. fsize: a file-size limit (bytes) on each rank, as a full disk would stop its
    writes. Past `timeout`, or once `cancel` is set, every rank is killed (subprocess.TimeoutExpired)."""
    target = [str(a) for a in target]
    base = dict(env() if environ is None else environ)
    with hold_port() as held:
        if nproc > 1:
            base.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(held.getsockname()[1]))
        return _launch(target, nproc, cwd, base, timeout, fsize, cancel)


def hold_port() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1 (getsockname()[1]), for rank 0's store: keep it open
    until the ranks are done. Held -- bound with SO_REUSEADDR, not listening -- the port is given to no
    other bind(0) nor outgoing connection of a busy machine, so nothing takes it between the pick and
    rank 0's bind (TCPStore binds with SO_REUSEADDR too, which a held port lets through), and no rank
    of this launch meets another run's store on it. A port picked and released has both races."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


def _launch(target, nproc, cwd, base, timeout, fsize, cancel) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="braidtrain-launch-") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        open(out, "w").close(), open(err, "w").close()
        ranks = [_start(dict(target=target, cwd=str(cwd), out=out, err=err, fsize=fsize,
                             env=dict(base, **({"RANK": str(r), "LOCAL_RANK": str(r)} if nproc > 1 else {}))))
                 for r in range(nproc)]
        codes: list[int | None] = [None] * nproc
        first, deadline, grace = None, time.monotonic() + timeout, None
        sel = selectors.DefaultSelector()
        try:
            for r, (conn, _, _) in enumerate(ranks):
                sel.register(conn, selectors.EVENT_READ, r)
            while None in codes:
                if time.monotonic() > deadline or (cancel is not None and cancel.is_set()):
                    raise subprocess.TimeoutExpired(target, timeout)
                if grace is not None and time.monotonic() > grace:  # as torchrun: SIGKILL 30 s after SIGTERM
                    for (_, _, pid), c in zip(ranks, codes):
                        if c is None:
                            _signal(pid, signal.SIGKILL)
                    grace = None
                for key, _ in sel.select(timeout=0.5):
                    r = key.data
                    codes[r] = int(ranks[r][1].readline() or -9)
                    sel.unregister(key.fileobj)
                    if codes[r] != 0 and first is None:  # as torchrun: a failed rank ends the group
                        first, grace = codes[r], time.monotonic() + 30
                        for (_, _, pid), c in zip(ranks, codes):
                            if c is None:
                                _signal(pid, signal.SIGTERM)
        finally:
            sel.close()
            for (conn, f, pid), c in zip(ranks, codes):
                if c is None:
                    _signal(pid, signal.SIGKILL)
                f.close()
                conn.close()
        read = lambda path: Path(path).read_text(encoding="utf-8", errors="replace")
        return subprocess.CompletedProcess(target, first or 0, read(out), read(err))


def forked(cmd: list, env: dict | None = None, path: str = "") -> subprocess.CompletedProcess:
    """What subprocess.run(cmd) would return for `python [-m torch.distributed.run --standalone
    --nproc-per-node=N] ARGS`, the command forked instead (launch): a stand-in for the `run_job`
    of bench/train.py and plan/check.py, which start such commands. path: folders (os.pathsep
    between) the command finds modules in beside the repository's, as PYTHONPATH."""
    cmd = [str(a) for a in cmd]
    assert cmd[0] == sys.executable, cmd
    cmd, nproc = cmd[1:], 1
    if cmd[:3] == ["-m", "torch.distributed.run", "--standalone"]:
        nproc, cmd = int(cmd[3].removeprefix("--nproc-per-node=")), cmd[4:]
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), path]))
    return launch(*cmd, nproc=nproc, environ=dict(env or os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath))


def braidtrain(*args, nproc: int = 1, timeout: float = 300, check: bool = True, cwd=ROOT, environ=None,
               fsize=None) -> subprocess.CompletedProcess:
    """`python -m braidtrain ARGS` as nproc ranks (launch); check: fail the test on a non-zero exit."""
    p = launch("-m", "braidtrain", *args, nproc=nproc, timeout=timeout, cwd=cwd, environ=environ, fsize=fsize)
    if check and p.returncode != 0:
        raise AssertionError(f"braidtrain {' '.join(map(str, args))} ({nproc} ranks) exited {p.returncode}\n"
                             f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summary(run: Path) -> dict:
    return json.loads((Path(run) / "summary.json").read_text())


def prepare_bytes(out: Path) -> Path:
    braidtrain("data", "prepare", "--corpus", "shakespeare", "--tokenizer", "bytes", "--out", out)
    return out


def run_interpreted(script: str) -> dict:
    """Run a test file as a script under Triton's CPU interpreter (TRITON_INTERPRET=1 must be set
    before triton is first imported, and pytest shares one process between files): the JSON its
    last line prints. Skips where triton is not installed (`make test` installs it)."""
    return interpreted_result(start_interpreted(script))


def start_interpreted(script: str):
    """run_interpreted's process, started in the background (None where triton is not installed),
    for interpreted_result to wait for: a test file's other tests run meanwhile."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return None
    return subprocess.Popen([sys.executable, script], cwd=ROOT, env=dict(env(), TRITON_INTERPRET="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def interpreted_result(p) -> dict:
    import pytest

    if p is None:
        pytest.skip("triton is not installed")
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-5000:]
    return json.loads(out.strip().splitlines()[-1])


class Layouts:
    """tests/layouts_worker.py's suites of layouts, run one after another in one 8-rank process
    group, started in the background (conftest.py starts it before the first test); `results()`
    waits for it: suite -> its results. One launch a session: under pytest-xdist every worker
    asks for it with the same folder, the first to create the folder starts it, and each reads
    the results once the launch's exit code is in OUT/rc. The ranks are forked by the tests'
    process server (launch, in a thread): what torchrun gives its workers, without 9 interpreters
    importing torch."""

    def __init__(self, out: Path, suites: list[str]):
        self.out, self.suites, self.thread = Path(out), suites, None
        try:
            self.out.mkdir(parents=True)  # (atomic: one worker starts the launch)
        except FileExistsError:
            return
        self.cancel = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        """The launch; then its output to OUT/log.txt and its exit code to OUT/rc."""
        try:
            p = launch(ROOT / "tests" / "layouts_worker.py", self.out, ",".join(self.suites), nproc=8, timeout=1800,
                       cancel=self.cancel)
            log, rc = p.stdout + p.stderr, p.returncode
        except Exception as e:  # (its timeout, or stopped)
            log, rc = f"the layouts launch: {e!r}", -1
        (self.out / "log.txt").write_text(log)
        (self.out / "rc.part").write_text(str(rc))
        os.replace(self.out / "rc.part", self.out / "rc")

    def results(self, timeout: float = 1800) -> dict:
        deadline = time.monotonic() + timeout
        while not (self.out / "rc").exists():
            assert time.monotonic() < deadline, f"the layouts launch did not end within {timeout} s"
            time.sleep(0.5)
        rc = int((self.out / "rc").read_text())
        log = (self.out / "log.txt").read_text()
        first = log.find("Traceback")  # the first rank to fail (the others' errors follow: their peer was lost)
        assert rc == 0, (log[first:first + 3000] + "\n...\n" if first >= 0 else "") + log[-2000:]
        return {s: json.loads((self.out / f"results_{s}.json").read_text()) for s in self.suites}

    def stop(self, wait: bool = False) -> None:
        """End the launch (its ranks killed); `wait`: let it finish first (other xdist workers may
        still read its results)."""
        if self.thread is None:
            return
        if not wait:
            self.cancel.set()
        self.thread.join(1800)


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
