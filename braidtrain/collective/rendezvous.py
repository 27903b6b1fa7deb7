"""How the ranks meet, whatever launched them.

Four ways in (llm.c's -pi flag):
  env  torchrun's RANK/WORLD_SIZE/LOCAL_RANK, else Slurm's SLURM_PROCID/..., else one process
  tcp  every rank started by hand; rank 0 serves the rendezvous at -ps host[:port]
  fs   rank 0 serves on a free port and writes "host:port nonce" into the shared folder -pf
  mpi  mpirun starts the ranks; rank 0 broadcasts host:port through MPI

All of them end the same way: one TCPStore (hosted by rank 0, or by torchrun's agent),
a check-in on it where every rank reports the world size it was started with, and then
init_process_group on that store. The check-in is what turns a bad launch (wrong -pn,
a missing rank, two ranks with the same -pr) into the same one-line error on every
rank instead of a hang in the first collective.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
import zlib
from datetime import timedelta

import torch.distributed as dist

from braidtrain.errors import UserError

DEFAULT_PORT = 29500
FS_FILE = "braidtrain_rendezvous.txt"  # the file rank 0 publishes inside -pf
_POLL_S = 0.2
_OK = "ok"


def from_env(deadline, timeout_s):
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, or set by hand
        names = "RANK", "WORLD_SIZE", "LOCAL_RANK"
        prefix = f"braidtrain/{env.get('TORCHELASTIC_RUN_ID', 'run')}"  # init_runtime adds the attempt
        who = "RANK/WORLD_SIZE are set"
    elif "SLURM_PROCID" in env:
        names, prefix, who = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"), "braidtrain/slurm", "under Slurm"
    else:
        return 0, 1, 0, None
    try:
        rank, world, local = (int(env.get(n, "0")) for n in names)
    except ValueError:
        raise UserError(f"environment variables {', '.join(names)} must be integers") from None
    # torchrun's agent already serves a store at MASTER_ADDR:MASTER_PORT; we must join it, not bind.
    serve = rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    if world > 1 and not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
        raise UserError(f"{who} but MASTER_ADDR/MASTER_PORT are not: export the host and a free port of rank 0")
    rank, world = _check_rank(world, rank)
    host, port = env.get("MASTER_ADDR"), _port(env.get("MASTER_PORT", "1"))
    return rank, world, local, lambda: (open_store(host, port, world, serve, deadline, timeout_s), prefix)


def from_mpi(num_processes, process_rank, deadline, timeout_s):
    try:
        from mpi4py import MPI
    except ImportError:
        raise UserError("-pi mpi needs mpi4py (pip install mpi4py) and an MPI launcher (mpirun)") from None
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    # MPI collectives never time out, so all of them happen first, before anything on one rank can raise;
    # rank 0 broadcasts even its own failure. From then on only the store's bounded waits remain.
    # GPU index = how many lower ranks share my host. crc32, because hash() is salted per process.
    mine = zlib.crc32(socket.gethostname().split(".")[0].encode())
    local = sum(1 for h in comm.allgather(mine)[:rank] if h == mine)
    store, info = None, None
    if rank == 0 and world > 1:
        try:
            host = _my_address()
            store, prefix = with_nonce(open_store(host, 0, world, True, deadline, timeout_s), True)
            info = (host, store.port, prefix)
        except UserError as e:
            info = str(e)
    info = comm.bcast(info, root=0)
    if isinstance(info, str):
        raise UserError(info)
    if num_processes not in (None, world) or process_rank not in (None, rank):
        raise UserError(f"mpirun started {world} processes (this is rank {rank}) but -pn {num_processes} "
                        f"-pr {process_rank} were given: drop -pn/-pr with -pi mpi")

    def connect():
        hint = "set BRAIDTRAIN_HOST to an address of rank 0's node that the other nodes can reach"
        if store is not None:
            return store, info[2]
        return open_store(info[0], info[1], world, False, deadline, timeout_s, hint), info[2]
    return rank, world, local, connect


def open_store(host, port, world, serve, deadline, timeout_s, hint="is rank 0 running, and is -ps right?"):
    """Rank 0 (serve=True) hosts the store; the others wait, bounded by the deadline, until they reach it."""
    left = timedelta(seconds=max(1.0, deadline - time.monotonic()))
    if serve:
        try:  # port 0 picks a free one (see store.port); wait_for_workers=False: the check-in waits instead
            store = dist.TCPStore(host, port, world, True, timeout=left, wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            raise UserError(f"rank 0 could not serve the rendezvous on {host}:{port}: {first_line(e)}") from None
        return store
    # Probe with a plain socket first: TCPStore's own connect retries noisily and overruns its timeout.
    failure = f"could not reach the rendezvous at {host}:{port} within {timeout_s:g} s: {hint}"
    while not _reachable(host, port, deadline):
        if time.monotonic() + _POLL_S >= deadline:
            raise UserError(failure)
        time.sleep(_POLL_S)
    try:  # something answered; a proxy or another program fails TCPStore's handshake
        return dist.TCPStore(host, port, world, False, timeout=left)
    except RuntimeError as e:
        raise UserError(f"{failure} ({first_line(e)})") from None


def with_nonce(store, serve):
    """(store, prefix): rank 0 names this run with a fresh nonce, the others read it. For fs it also
    tells a live store of this run from whatever now listens on a port named in a stale file."""
    if serve:
        store.set("braidtrain/nonce", uuid.uuid4().hex[:12])
    try:
        return store, f"braidtrain/{store.get('braidtrain/nonce').decode()}"
    except RuntimeError:
        raise UserError("the rendezvous store answered but never named its run: is another program on that "
                        "port?") from None


def fs_store(folder, rank, world, deadline, timeout_s):
    path = os.path.join(folder, FS_FILE)
    if rank == 0:
        # A file left by an earlier run would send the others to a dead port: remove it first.
        # The others also check the nonce, for the case that they read it before we got here.
        if os.path.exists(path):
            os.remove(path)
        host = _my_address()
        store, prefix = with_nonce(open_store(host, 0, world, True, deadline, timeout_s), True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:  # write then rename: nobody ever reads half a file
            f.write(f"{host}:{store.port} {prefix}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return store, prefix
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                addr, prefix = f.read().split()
            host, port = parse_server(addr)
            if _reachable(host, port, deadline):
                left = timedelta(seconds=max(1.0, min(5.0, deadline - time.monotonic())))
                store = dist.TCPStore(host, port, world, False, timeout=left)
                if with_nonce(store, False)[1] == prefix:
                    return store, prefix
        except (OSError, ValueError, RuntimeError, UserError):
            pass  # not written yet, or stale: its port is dead or serves some other run
        time.sleep(_POLL_S)
    raise UserError(f"no live rendezvous from rank 0 appeared in {path} within {timeout_s:g} s: "
                    f"is rank 0 running, with the same -pf?")


def check_in(store, rank, world, deadline, timeout_s):
    """Every rank posts the world size it was started with; the first problem anyone finds becomes
    the run's verdict (compare_set: first writer wins), so all ranks fail with the same message."""
    def fail(msg):
        verdict = store.compare_set("verdict", "", msg).decode()
        store.add("verdict_read", 1)
        # "ok": rank 0 had found its world complete before this process got here -- a second process
        # with this rank, or a rank of another run that serves this port: its own finding is the news.
        raise UserError(msg if verdict == _OK else verdict)

    store.set(f"np/{rank}", str(world))
    store.add("arrived", 1)  # (duplicates included: rank 0 waits for all of them to read a failure)
    if store.add(f"seen/{rank}", 1) > 1:
        fail(f"two processes were started as rank {rank} at this rendezvous: give each process its own -pr "
             f"(and each run its own port)")
    if rank != 0:
        try:  # the store's timeout is what is left of ours
            theirs = int(store.get("np/0"))
            # Ranks above rank 0's world size are never looked at by rank 0, so each rank checks itself.
            if theirs != world:
                fail(f"rank {rank} was started with -pn {world} but rank 0 with -pn {theirs}: "
                     f"start every process with the same -pn")
            verdict = store.get("verdict").decode()
        except RuntimeError:
            raise UserError(f"rank 0 did not confirm that all {world} processes arrived within "
                            f"{timeout_s:g} s") from None
        try:
            store.add("verdict_read", 1)
        except RuntimeError:  # rank 0 stopped waiting (and its store went with it): the verdict is read
            pass
        if verdict != _OK:
            raise UserError(verdict)
        return
    pending, msg = set(range(1, world)), None
    while pending and msg is None and not store.check(["verdict"]):
        for i in [i for i in pending if store.check([f"np/{i}"])]:
            pending.discard(i)
            if (theirs := int(store.get(f"np/{i}"))) != world:
                msg = (f"rank {i} was started with -pn {theirs} but rank 0 with -pn {world}: start every process "
                       "with the same -pn")
        if pending and time.monotonic() >= deadline:
            msg = (f"only {world - len(pending)} of {world} processes reached the rendezvous within "
                   f"{timeout_s:g} s: start all ranks 0..{world - 1}, each with -pn {world}")
        time.sleep(_POLL_S if pending and msg is None else 0)
    verdict = store.compare_set("verdict", "", msg or _OK).decode()
    if verdict != _OK:
        # The store dies with this process: give the others a moment to read why before we exit.
        stop = time.monotonic() + 3.0
        while store.add("verdict_read", 0) < store.add("arrived", 0) - 1 and time.monotonic() < stop:
            time.sleep(_POLL_S)
        raise UserError(verdict)


def by_hand(num_processes, process_rank, gpus_per_node):
    """(rank, world, local rank) of a process started by hand, checked."""
    if gpus_per_node is not None and gpus_per_node < 1:
        raise UserError(f"-pg (GPUs per node) must be at least 1, got {gpus_per_node}")
    rank, world = _check_rank(num_processes, process_rank)
    return rank, world, rank % gpus_per_node if gpus_per_node else 0


def _check_rank(num_processes, process_rank):
    if num_processes is None or num_processes < 1:
        raise UserError(f"-pn (number of processes) must be at least 1, got {num_processes}")
    rank = 0 if process_rank is None and num_processes == 1 else process_rank
    if rank is None or not 0 <= rank < num_processes:
        raise UserError(f"-pr (process rank) must be in 0..{num_processes - 1} for -pn {num_processes}, got "
                        f"{process_rank}")
    return rank, num_processes


def _port(text):
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise UserError(f"port {text!r} is not a port number (1..65535)")
    return int(text)


def parse_server(server):
    host, sep, port = server.rpartition(":")
    if not sep or ":" in host and not host.startswith("["):  # "host" alone, or a bare IPv6 address
        return server, DEFAULT_PORT
    return host.strip("[]"), _port(port)


def _reachable(host, port, deadline):
    try:
        with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
            return True
    except socket.gaierror:
        raise UserError(f"cannot resolve the rendezvous host {host!r}: check the address") from None
    except OSError:
        return False


def _my_address():
    """An address of this host that other nodes can reach: BRAIDTRAIN_HOST if set, else the interface
    that routes outward (a UDP connect sends no packet), else whatever the host name resolves to."""
    if os.environ.get("BRAIDTRAIN_HOST"):
        return os.environ["BRAIDTRAIN_HOST"]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def first_line(e):
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
