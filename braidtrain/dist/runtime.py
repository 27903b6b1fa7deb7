"""Who am I? Rank, world size, device and process group, whatever launched us.

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
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from braidtrain.errors import UserError

DEFAULT_PORT = 29500
FS_FILE = "braidtrain_rendezvous.txt"  # the file rank 0 publishes inside -pf
_POLL_S = 0.2
_OK = "ok"
HIGH_PRIORITY = ("world", "dp", "replica", "cp", "tp")  # mesh axes whose NCCL groups get high-priority streams


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    init_method: str
    store: "dist.Store | None" = None  # keys here are private to this run and attempt (prefixed)
    # keys that outlive a restart of the group: torchrun's agent keeps its store across restarts
    launch_store: "dist.Store | None" = None
    attempt: int = 0  # torchrun's restart count (TORCHELASTIC_RESTART_COUNT); 0 for other launchers
    _owns_group: bool = field(default=False, repr=False)
    _store_addr: tuple | None = field(default=None, repr=False)  # (host, port, key prefix of `store`)
    _env_set: list = field(default_factory=list, repr=False)  # variables default_env set; close() unsets them
    _connect: object = field(default=None, repr=False)  # find_runtime's way to the store, for join()
    _deadline: float = field(default=0.0, repr=False)
    _timeout: float = field(default=300.0, repr=False)
    _fs_file: str | None = field(default=None, repr=False)  # -pi fs: the file rank 0 removes once all are in

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        # NCCL would otherwise guess the GPU from the rank and warn about it.
        dist.barrier(device_ids=[self.device.index]) if self.backend == "nccl" else dist.barrier()

    def cpu_sum(self, x: float) -> float:
        """x summed over ranks 0..N-1 in that order, in float64: bit-identical on every rank,
        unlike all_reduce whose summation order depends on the backend's algorithm."""
        if self.world_size == 1:
            return float(x)
        mine = torch.tensor([float(x)], dtype=torch.float64, device=self.device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine)
        total = 0.0
        for v in torch.cat(parts).tolist():
            total += v
        return total

    def log(self, *args) -> None:
        if self.is_main:
            print(*args, flush=True)

    def connect(self, timeout_s: float) -> "dist.Store":
        """A second client connection to the store, with the same keys as `store`: for a thread (the
        heartbeat) that must neither share the main thread's connection nor wait behind it."""
        host, port, prefix = self._store_addr
        client = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout_s))
        return dist.PrefixStore(prefix, client)

    def default_env(self, **values: str) -> None:
        """Set these environment variables where the user has not (their own setting wins), until close()."""
        for k, v in values.items():
            if k not in os.environ:
                os.environ[k] = v
                self._env_set.append(k)

    def group_options(self, axis: str):
        """The backend's options for the process groups of a mesh axis: NCCL's kernels on
        high-priority streams for the data-parallel groups, whose collectives overlap compute (a
        collective then gets its SMs as soon as blocks free up, rather than queueing behind the
        compute kernels': ZeRO-3 on two H200s 686k -> 807k tokens/s, ZeRO-0/1 unchanged,
        docs/performance.md), and for tp's, as measured with them; the others keep NCCL's
        defaults. None: the defaults -- also wherever the user set TORCH_NCCL_HIGH_PRIORITY."""
        if self.backend != "nccl" or axis not in HIGH_PRIORITY or "TORCH_NCCL_HIGH_PRIORITY" in os.environ:
            return None
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = True
        opts._timeout = timedelta(seconds=self._timeout)  # what torch sets it to (else it warns)
        return opts

    def new_group(self, ranks: list[int], axis: str):
        """The process group of one line of the mesh (mesh.build_mesh calls it on every rank for
        every line, in the same order), with the run's timeout and its axis's options."""
        opts = self.group_options(axis)
        return dist.new_group(ranks, timeout=timedelta(seconds=self._timeout),
                              **({"pg_options": opts} if opts is not None else {}))

    def join(self, nccl_protocol: str | None = None) -> None:
        """Rendezvous and the world's process group. nccl_protocol: NCCL_PROTO for this process
        (the trainer's choice by layout, docs/design-notes.md); None leaves NCCL its own choice.
        NCCL reads it once, for every communicator of the process: unlike the stream priority,
        it has no per-group setting."""
        if self.world_size == 1:
            return  # nothing to agree on; no process group, no store
        rank, world, timeout_s = self.rank, self.world_size, self._timeout
        store, prefix = self._connect()  # prefix: this launch's own key space in the store
        # torchrun's agent keeps its store across restarts, so each attempt gets its own key space
        launch = dist.PrefixStore(prefix, store)
        run = dist.PrefixStore(str(self.attempt), launch)
        _check_in(run, rank, world, self._deadline, timeout_s)
        if self._fs_file and rank == 0:  # everyone is in: don't leave a stale file for the next run
            os.remove(self._fs_file)
        store.set_timeout(timedelta(seconds=timeout_s))  # later users (heartbeat) get the full timeout
        if self.backend == "nccl" and nccl_protocol:
            self.default_env(NCCL_PROTO=nccl_protocol)
        try:
            dist.init_process_group(self.backend, store=dist.PrefixStore("pg", run), rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s), pg_options=self.group_options("world"),
                                    **({"device_id": self.device} if self.backend == "nccl" else {}))
        except (RuntimeError, ValueError) as e:
            self.close()  # the environment as it was
            raise UserError(f"rank {rank}: setting up the {self.backend} process group failed: {_first_line(e)}") from None
        self.store, self.launch_store, self._owns_group = dist.PrefixStore("app", run), launch, True
        self._store_addr = (store.host, store.port, f"{prefix}/{self.attempt}/app")

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False
        for k in self._env_set:
            os.environ.pop(k, None)
        self._env_set = []


def init_runtime(init_method: str = "env", *, nccl_protocol: str | None = None, **launch) -> Runtime:
    """find_runtime(...), then join(): who am I, then the process group."""
    rt = find_runtime(init_method, **launch)
    rt.join(nccl_protocol)
    return rt


def find_runtime(init_method: str = "env", *, num_processes: int | None = None,
                 process_rank: int | None = None, gpus_per_node: int | None = None,
                 server: str | None = None, fs_path: str | None = None,
                 device: str | None = None, timeout_s: float = 300.0) -> Runtime:
    """Who am I: rank, world size, device -- known before the ranks meet, so that the layout can
    be validated before any process group forms. Runtime.join() then forms it."""
    if timeout_s <= 0:
        raise UserError(f"the rendezvous timeout must be positive, got {timeout_s}")
    deadline = time.monotonic() + timeout_s
    if init_method == "env":
        rank, world, local, connect = _from_env(deadline, timeout_s)
    elif init_method == "tcp":
        if not server:
            raise UserError("-pi tcp needs -ps ADDRESS[:PORT], the host of rank 0 (e.g. -ps 10.0.0.1:29500)")
        (rank, world, local), (host, port) = _by_hand(num_processes, process_rank, gpus_per_node), _parse_server(server)
        connect = lambda: _with_nonce(_open_store(host, port, world, rank == 0, deadline, timeout_s), rank == 0)
    elif init_method == "fs":
        if not fs_path or not os.path.isdir(fs_path):
            raise UserError(f"-pf folder {fs_path} does not exist: create it on a filesystem all nodes share"
                            if fs_path else "-pi fs needs -pf FOLDER, a folder that all nodes share")
        rank, world, local = _by_hand(num_processes, process_rank, gpus_per_node)
        connect = lambda: _fs_store(fs_path, rank, world, deadline, timeout_s)
    elif init_method == "mpi":
        rank, world, local, connect = _from_mpi(num_processes, process_rank, deadline, timeout_s)
    else:
        raise UserError(f"unknown init method {init_method!r}: use one of env, tcp, fs, mpi")

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if init_method == "env" else "0"
    if not attempt.isdigit():
        raise UserError(f"TORCHELASTIC_RESTART_COUNT must be an integer, got {attempt!r}")
    dev, backend = _pick_device(device, local)
    rt = Runtime(rank, world, local, dev, backend, init_method, attempt=int(attempt))
    rt._connect, rt._deadline, rt._timeout = connect, deadline, timeout_s
    if init_method == "fs":
        rt._fs_file = os.path.join(fs_path, FS_FILE)
    return rt


# ---------------------------------------------------------------- who launched us

def _from_env(deadline, timeout_s):
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
    return rank, world, local, lambda: (_open_store(host, port, world, serve, deadline, timeout_s), prefix)


def _from_mpi(num_processes, process_rank, deadline, timeout_s):
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
            store, prefix = _with_nonce(_open_store(host, 0, world, True, deadline, timeout_s), True)
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
        return _open_store(info[0], info[1], world, False, deadline, timeout_s, hint), info[2]
    return rank, world, local, connect


# ---------------------------------------------------------------- the store

def _open_store(host, port, world, serve, deadline, timeout_s, hint="is rank 0 running, and is -ps right?"):
    """Rank 0 (serve=True) hosts the store; the others wait, bounded by the deadline, until they reach it."""
    left = timedelta(seconds=max(1.0, deadline - time.monotonic()))
    if serve:
        try:  # port 0 picks a free one (see store.port); wait_for_workers=False: the check-in waits instead
            store = dist.TCPStore(host, port, world, True, timeout=left, wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            raise UserError(f"rank 0 could not serve the rendezvous on {host}:{port}: {_first_line(e)}") from None
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
        raise UserError(f"{failure} ({_first_line(e)})") from None


def _with_nonce(store, serve):
    """(store, prefix): rank 0 names this run with a fresh nonce, the others read it. For fs it also
    tells a live store of this run from whatever now listens on a port named in a stale file."""
    if serve:
        store.set("braidtrain/nonce", uuid.uuid4().hex[:12])
    try:
        return store, f"braidtrain/{store.get('braidtrain/nonce').decode()}"
    except RuntimeError:
        raise UserError("the rendezvous store answered but never named its run: is another program on that port?") from None


def _fs_store(folder, rank, world, deadline, timeout_s):
    path = os.path.join(folder, FS_FILE)
    if rank == 0:
        # A file left by an earlier run would send the others to a dead port: remove it first.
        # The others also check the nonce, for the case that they read it before we got here.
        if os.path.exists(path):
            os.remove(path)
        host = _my_address()
        store, prefix = _with_nonce(_open_store(host, 0, world, True, deadline, timeout_s), True)
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
            host, port = _parse_server(addr)
            if _reachable(host, port, deadline):
                left = timedelta(seconds=max(1.0, min(5.0, deadline - time.monotonic())))
                store = dist.TCPStore(host, port, world, False, timeout=left)
                if _with_nonce(store, False)[1] == prefix:
                    return store, prefix
        except (OSError, ValueError, RuntimeError, UserError):
            pass  # not written yet, or stale: its port is dead or serves some other run
        time.sleep(_POLL_S)
    raise UserError(f"no live rendezvous from rank 0 appeared in {path} within {timeout_s:g} s: "
                    f"is rank 0 running, with the same -pf?")


def _check_in(store, rank, world, deadline, timeout_s):
    """Every rank posts the world size it was started with; the first problem anyone finds becomes
    the run's verdict (compare_set: first writer wins), so all ranks fail with the same message."""
    def fail(msg):
        verdict = store.compare_set("verdict", "", msg).decode()
        store.add("verdict_read", 1)
        raise UserError(verdict)

    store.set(f"np/{rank}", str(world))
    store.add("arrived", 1)  # (duplicates included: rank 0 waits for all of them to read a failure)
    if store.add(f"seen/{rank}", 1) > 1:
        fail(f"two processes were started as rank {rank}: give each process its own -pr")
    if rank != 0:
        try:  # the store's timeout is what is left of ours
            theirs = int(store.get("np/0"))
            # Ranks above rank 0's world size are never looked at by rank 0, so each rank checks itself.
            if theirs != world:
                fail(f"rank {rank} was started with -pn {world} but rank 0 with -pn {theirs}: "
                     f"start every process with the same -pn")
            verdict = store.get("verdict").decode()
        except RuntimeError:
            raise UserError(f"rank 0 did not confirm that all {world} processes arrived within {timeout_s:g} s") from None
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
                msg = f"rank {i} was started with -pn {theirs} but rank 0 with -pn {world}: start every process with the same -pn"
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


# ---------------------------------------------------------------- small helpers

def _pick_device(device, local_rank):
    name = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu"), "gloo"
    if name != "cuda" and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise UserError(f"unknown device {name!r}: use cpu, cuda or cuda:N")
    dev = torch.device(name) if ":" in name else torch.device("cuda", local_rank)
    if not dev.index < torch.cuda.device_count():  # also when torch sees no GPU at all
        raise UserError(f"this process needs GPU {dev.index} but torch sees {torch.cuda.device_count()} here: "
                        f"start fewer processes per node, lower -pg, or use --device cpu")
    torch.cuda.set_device(dev)
    return dev, "nccl"


def _by_hand(num_processes, process_rank, gpus_per_node):
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
        raise UserError(f"-pr (process rank) must be in 0..{num_processes - 1} for -pn {num_processes}, got {process_rank}")
    return rank, num_processes


def _port(text):
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise UserError(f"port {text!r} is not a port number (1..65535)")
    return int(text)


def _parse_server(server):
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


def _first_line(e):
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
