"""Runtime: every init method really rendezvouses (2 processes on gloo), and every bad launch fails
with a one-line UserError within its timeout instead of hanging."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from braidtrain.errors import UserError
from braidtrain.collective.rendezvous import FS_FILE, check_in
from braidtrain.collective.comm import Comm
from braidtrain.collective.mesh import build_mesh
from braidtrain.collective.runtime import init_runtime
from helpers import hold_port

REPO = Path(__file__).resolve().parents[1]

# Each child: init, a rank-ordered sum (Comm.ordered_sum) and a plain all_reduce, print one JSON line, close
# twice -- after which no thread of torch's or ours is left (its groups still referenced, as a script would),
# so that the interpreter's teardown has nothing to abort on (issue #55) -- and prints the count of those.
WORKER = """
import json, os, sys, time
if json.loads(sys.argv[1]).get("init_method") == "mpi":
    from mpi4py import MPI  # (MPI's own threads start here: they are not ours to join)
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
sys.path.insert(0, {repo!r})
import torch, torch.distributed as dist
from braidtrain.errors import UserError
from braidtrain.collective.comm import Comm
from braidtrain.collective.mesh import build_mesh
from braidtrain.collective.runtime import init_runtime
t0 = time.monotonic()
try:
    rt = init_runtime(**json.loads(sys.argv[1]))
except UserError as e:
    print(f"INIT_S {{time.monotonic() - t0:.2f}}", flush=True)
    print("USERERROR " + str(e), flush=True)
    sys.exit(2)
t = torch.tensor([float(rt.rank + 1)])
dist.all_reduce(t)
comm = Comm(rt.device)
world = build_mesh(rt.rank, rt.world_size, comm).groups["world"]
s = comm.ordered_sum(rt.rank + 1, world)
comm.barrier(world)
rt.store.set(f"hello/{{rt.rank}}", "x")  # the store is usable after init
print("RESULT " + json.dumps(dict(rank=rt.rank, world=rt.world_size, local=rt.local_rank, sum=s,
                                  ar=t.item(), backend=rt.backend, device=str(rt.device))), flush=True)
rt.close()
rt.close()
print(f"LEFT {{rt.rank}} {{threads() - before}}", flush=True)
"""


@pytest.fixture
def port():
    """A free port, held for the test (helpers.hold_port)."""
    with hold_port() as held:
        yield held.getsockname()[1]


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER.format(repo=str(REPO)))
    return str(path)


def child_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(k, None)
    return env


def run_all(cmds, timeout=60, stagger=0.0):
    """Start every command, wait for all, kill leftovers; return [(returncode, output)].
    Each command gets its own process group, so a launcher's children (torchrun, mpirun) die with it."""
    procs = []
    try:
        for cmd in cmds:
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          env=child_env(), cwd=REPO, start_new_session=True))
            time.sleep(stagger)
        out = [p.communicate(timeout=timeout)[0] for p in procs]
        return [(p.returncode, o) for p, o in zip(procs, out)]
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def results(runs):
    for rc, out in runs:
        assert rc == 0, out
    left = sorted(re.findall(r"LEFT (\d+) (-?\d+)", "".join(out for _, out in runs)))
    assert left == [("0", "0"), ("1", "0")], f"threads left after close (rank, count): {left}"
    # Children of one launcher share a pipe, so their lines may run together: pick the objects out.
    found = [json.loads(m) for _, out in runs for m in re.findall(r"RESULT (\{[^}]*\})", out)]
    return sorted(found, key=lambda r: r["rank"])


def user_errors(out):
    return [line[10:] for line in out.splitlines() if line.startswith("USERERROR ")]


def check_two_ranks(found, locals_=(0, 1)):
    assert [r["rank"] for r in found] == [0, 1]
    for r in found:
        assert r["world"] == 2 and r["backend"] == "gloo" and r["device"] == "cpu"
        assert r["sum"] == 3.0 and r["ar"] == 3.0
    assert tuple(r["local"] for r in found) == tuple(locals_)


def by_hand(worker, kwargs_per_rank):
    return [[sys.executable, worker, json.dumps(kw)] for kw in kwargs_per_rank]


# ------------------------------------------------------------------ the four init methods

def test_env_under_torchrun(worker, port):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port), worker, json.dumps({"device": "cpu"})]
    (rc, out), = run_all([cmd], timeout=90)
    assert rc == 0, out
    check_two_ranks(results([(rc, out)]))


def test_tcp_by_hand(worker, port):
    server = f"127.0.0.1:{port}"
    kws = [dict(init_method="tcp", num_processes=2, process_rank=r, gpus_per_node=2, server=server,
                device="cpu", timeout_s=60) for r in (1, 0)]  # rank 1 first: it must wait for rank 0
    check_two_ranks(results(run_all(by_hand(worker, kws))))


def test_fs_with_stale_file(worker, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    # Left over from an earlier run, and its port since taken by another run's live store: rank 1 starts
    # first, reads this file, reaches that store, and must notice the nonce is not the one in the file.
    other = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    other.set("braidtrain/nonce", "another0run0")
    (shared / FS_FILE).write_text(f"127.0.0.1:{other.port} braidtrain/0123456789ab\n")
    kws = [dict(init_method="fs", num_processes=2, process_rank=r, fs_path=str(shared), device="cpu",
                timeout_s=20) for r in (1, 0)]
    check_two_ranks(results(run_all(by_hand(worker, kws), stagger=1.0)), locals_=(0, 0))
    assert not (shared / FS_FILE).exists()  # rank 0 cleans up once everyone is in


def test_mpi(worker):
    missing = [what for what, ok in (("mpirun", shutil.which("mpirun")),
                                     ("mpi4py", _has_module("mpi4py"))) if not ok]
    if missing:
        pytest.skip(f"needs {' and '.join(missing)}")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, worker,
           json.dumps(dict(init_method="mpi", device="cpu", timeout_s=60))]
    (rc, out), = run_all([cmd], timeout=90)
    assert rc == 0, out
    check_two_ranks(results([(rc, out)]))  # one host: local ranks 0 and 1


def _has_module(name):
    import importlib.util
    return importlib.util.find_spec(name) is not None


def test_single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    rt = init_runtime(device="cpu")
    assert (rt.rank, rt.world_size, rt.local_rank, rt.store, rt.backend) == (0, 1, 0, None, "gloo")
    comm = Comm(rt.device)
    world = build_mesh(rt.rank, rt.world_size, comm).groups["world"]
    assert rt.is_main and comm.ordered_sum(2.5, world) == 2.5
    comm.barrier(world)
    rt.close()
    rt.close()


@pytest.mark.parametrize("tp, protocol", [(1, "Simple"), (2, None)])
def test_trainer_asks_nccl_protocol_by_layout(tmp_path, monkeypatch, shakespeare, tp, protocol):
    """Data parallelism alone asks for NCCL's Simple protocol when the process group is made
    (docs/design-notes.md); tp > 1 leaves NCCL its own choice. The layout is validated first:
    a rank that joins the group has a layout that can run."""
    import torch

    from braidtrain import build
    from braidtrain.options import Parser, train_config, train_parser

    asked = {}

    class Launched:  # two ranks found, the group not formed yet
        rank, world_size, attempt, device = 0, 2, 0, torch.device("cpu")

        def log(self, line):  # (rank 0's lines: the recipe's)
            pass

        def join(self, nccl_protocol=None):
            asked["nccl_protocol"] = nccl_protocol
            raise KeyboardInterrupt  # stop the trainer right there

    monkeypatch.setattr(build, "find_runtime", lambda *_a, **_k: Launched())
    argv = ["--model", "tiny", "-i", str(shakespeare), "--out", str(tmp_path / "run"), "--tp", str(tp)]
    with pytest.raises(KeyboardInterrupt):
        build.build(train_config(train_parser(Parser().add_subparsers(parser_class=Parser)).parse_args(argv)))
    assert asked["nccl_protocol"] == protocol


def test_default_env_yields_to_the_user_and_ends_with_close(monkeypatch):
    """Runtime.default_env (NCCL's variables): set where unset, a user's own value kept, and what it
    set gone again after close()."""
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    # setenv first, so that monkeypatch restores "unset" after the test whatever the code did
    monkeypatch.setenv("BT_TEST_A", "")
    monkeypatch.delenv("BT_TEST_A")
    monkeypatch.setenv("BT_TEST_B", "the user's")
    rt = init_runtime(device="cpu")
    rt.default_env(BT_TEST_A="ours", BT_TEST_B="ours")
    assert (os.environ["BT_TEST_A"], os.environ["BT_TEST_B"]) == ("ours", "the user's")
    rt.close()
    assert "BT_TEST_A" not in os.environ and os.environ["BT_TEST_B"] == "the user's"


# ------------------------------------------------------------------ bad launches

def test_unreachable_server_fails_in_time(port):
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        init_runtime("tcp", num_processes=2, process_rank=1, server=f"127.0.0.1:{port}",
                     device="cpu", timeout_s=3)
    assert time.monotonic() - t0 < 9
    msg = str(e.value)
    assert "could not reach the rendezvous at 127.0.0.1:" in msg and "-ps" in msg and "\n" not in msg


def test_server_that_is_not_a_rendezvous():
    # Something answers on the port but is not a TCPStore (a proxy, a web server): still one clear error.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def answer():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            conn.close()

    threading.Thread(target=answer, daemon=True).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(UserError, match=r"could not reach the rendezvous at 127\.0\.0\.1:\d+ within 3 s"):
            init_runtime("tcp", num_processes=2, process_rank=1, server=f"127.0.0.1:{listener.getsockname()[1]}",
                         device="cpu", timeout_s=3)
    finally:
        listener.close()
    assert time.monotonic() - t0 < 9


def test_missing_rank_is_counted(port):
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"only 1 of 2 processes reached the rendezvous"):
        init_runtime("tcp", num_processes=2, process_rank=0, server=f"127.0.0.1:{port}",
                     device="cpu", timeout_s=3)
    assert time.monotonic() - t0 < 9


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(init_method="tcp", num_processes=2, process_rank=2, server="x"), r"-pr .* 0\.\.1 .* got 2"),
    (dict(init_method="tcp", num_processes=2, process_rank=-1, server="x"), r"-pr .* got -1"),
    (dict(init_method="tcp", num_processes=0, process_rank=0, server="x"), r"-pn .* at least 1"),
    (dict(init_method="tcp", num_processes=2, process_rank=0), r"-pi tcp needs -ps"),
    (dict(init_method="fs", num_processes=2, process_rank=0), r"-pi fs needs -pf"),
    (dict(init_method="tcp", num_processes=2, process_rank=0, server="h:notaport"), r"not a port"),
    (dict(init_method="bogus"), r"unknown init method 'bogus'"),
    (dict(device="tpu"), r"cpu, cuda or cuda:N"),
])
def test_bad_arguments(kwargs, pattern):
    with pytest.raises(UserError, match=pattern):
        init_runtime(timeout_s=3, **kwargs)


def test_missing_fs_folder(tmp_path):
    with pytest.raises(UserError, match=r"-pf folder .*nope does not exist"):
        init_runtime("fs", num_processes=2, process_rank=0, fs_path=str(tmp_path / "nope"))


def test_mpi_without_mpi4py(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` raise ImportError
    with pytest.raises(UserError) as e:
        init_runtime("mpi")
    assert str(e.value) == "-pi mpi needs mpi4py (pip install mpi4py) and an MPI launcher (mpirun)"


def test_mismatched_num_processes(worker, port):
    server = f"127.0.0.1:{port}"
    kws = [dict(init_method="tcp", num_processes=n, process_rank=r, server=server, device="cpu", timeout_s=20)
           for r, n in ((0, 2), (1, 3))]
    for rc, out in run_all(by_hand(worker, kws), timeout=40):
        assert rc == 2, out
        errs = user_errors(out)
        assert len(errs) == 1 and "-pn 3" in errs[0] and "-pn 2" in errs[0], out
        # Well before the 20 s timeout (the time in init_runtime, which leaves out the slow torch import).
        assert float(re.search(r"INIT_S (\S+)", out).group(1)) < 15, out


def test_duplicate_rank(port):
    # Two callers claim rank 1 of 3 while rank 0 waits: all three must fail, the store never hangs.
    server, errors = f"127.0.0.1:{port}", []

    def call(rank):
        try:
            init_runtime("tcp", num_processes=3, process_rank=rank, server=server, device="cpu", timeout_s=10)
        except UserError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=call, args=(r,)) for r in (0, 1, 1)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    for t in threads:
        t.join(20)
    assert len(errors) == 3 and all("started as rank 1" in e for e in errors), errors


@pytest.mark.parametrize("rank, world, says", [
    (1, 2, "two processes were started as rank 1 at this rendezvous"),
    (2, 3, "rank 2 was started with -pn 3 but rank 0 with -pn 2"),
])
def test_a_latecomer_to_a_finished_check_in_is_told_what_it_found(rank, world, says):
    """A process that reaches a store after its world of 2 checked in (verdict "ok") -- a second process
    with a rank, or a rank of another run whose store holds that port -- fails with what it found: never
    the verdict "ok" itself (a loaded round once printed `braidtrain: error: ok`)."""
    store, deadline = dist.HashStore(), time.monotonic() + 20
    store.set_timeout(timedelta(seconds=20))
    world_of_two = [threading.Thread(target=check_in, args=(store, r, 2, deadline, 20)) for r in (0, 1)]
    for th in world_of_two:
        th.start()
    for th in world_of_two:
        th.join(30)
    assert store.get("verdict") == b"ok"
    with pytest.raises(UserError) as e:
        check_in(store, rank, world, deadline, 20)
    assert says in str(e.value), str(e.value)


def test_exact_cublas_variable_goes_once_checked_on_compute_capability_9_0(monkeypatch):
    """Exact mode sets CUBLAS_WORKSPACE_CONFIG for torch's one check of it. While it is set every
    cuBLAS call costs the host more (issue #25), so on compute capability 9.0, where torch's own
    workspace is that size without it, one matmul passes the check and the variable goes; on
    another GPU it stays (the workspace would differ)."""
    import torch

    from braidtrain import build

    for capability, stays in (((9, 0), False), ((8, 0), True)):
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _device, c=capability: c)
        build._cublas_checked(torch.device("cpu"))
        assert ("CUBLAS_WORKSPACE_CONFIG" in os.environ) == stays, capability
