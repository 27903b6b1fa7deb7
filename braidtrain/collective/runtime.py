"""Who am I? Rank, world size and device, known before the ranks meet (find_runtime), so that the
layout is validated before any process group forms; then the process group (Runtime.join). How
the ranks meet, whatever launched them (llm.c's -pi env, tcp, fs, mpi): collective/rendezvous.py.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from braidtrain.collective.rendezvous import (FS_FILE, by_hand, check_in, first_line, from_env, from_mpi, fs_store,
                                       open_store, parse_server, with_nonce)
from braidtrain.errors import UserError

CLOSE_WAIT_S = 30.0  # how long the store's server waits at the end for the other ranks to let go of it
HIGH_PRIORITY = ("world", "dp", "replica", "cp", "tp")  # mesh axes whose NCCL groups get high-priority streams


@dataclass
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    init_method: str
    store: dist.Store | None = None  # keys here are private to this run and attempt (prefixed)
    # keys that outlive a restart of the group: torchrun's agent keeps its store across restarts
    launch_store: dist.Store | None = None
    attempt: int = 0  # torchrun's restart count (TORCHELASTIC_RESTART_COUNT); 0 for other launchers
    _owns_group: bool = field(default=False, repr=False)
    _store_addr: tuple | None = field(default=None, repr=False)  # (host, port, key prefix of `store`)
    _env_set: list = field(default_factory=list, repr=False)  # variables default_env set; close() unsets them
    _connect: object = field(default=None, repr=False)  # find_runtime's way to the store, for join()
    _deadline: float = field(default=0.0, repr=False)
    _timeout: float = field(default=300.0, repr=False)
    _fs_file: str | None = field(default=None, repr=False)  # -pi fs: the file rank 0 removes once all are in
    _serves: bool = field(default=False, repr=False)  # this process hosts the store's server

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, *args) -> None:
        if self.is_main:
            print(*args, flush=True)

    def connect(self, timeout_s: float) -> dist.Store:
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
        compute kernels': ZeRO-3 gained most, docs/design-notes.md), and for tp's; the others keep
        NCCL's defaults. None: the defaults -- also wherever the user set TORCH_NCCL_HIGH_PRIORITY."""
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
        check_in(run, rank, world, self._deadline, timeout_s)
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
            raise UserError(f"rank {rank}: setting up the {self.backend} process group failed: "
                            f"{first_line(e)}") from None
        self.store, self.launch_store, self._owns_group = dist.PrefixStore("app", run), launch, True
        self._serves = rank == 0 and not (self.init_method == "env" and
                                          os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
        self._store_addr = (store.host, store.port, f"{prefix}/{self.attempt}/app")

    def close(self, clean: bool = True) -> None:
        """The end of this rank's part in the run, in order, so that the interpreter's own teardown
        finds no thread that could still run Python (which aborts the process: "terminate called
        without an active exception", issue #55): the process groups destroyed -- and so freed, gloo's
        worker threads joined (braidtrain's Groups only refer to them: group.Group) -- then the store:
        each client goes before the server (rank 0's, unless torchrun's agent serves it), which waits
        for them after a clean run (`clean`: every rank is past its last collective). Idempotent."""
        others = self.world_size - 1
        if self._owns_group and dist.is_initialized():
            others = dist.get_world_size() - 1  # (live recovery's world may be smaller now)
            dist.destroy_process_group()
        self._owns_group = False
        if self.store is not None:
            try:
                if not self._serves:
                    self.store.add("closed", 1)  # (rank 0 may be gone already after a failure)
                elif clean:
                    stop = time.monotonic() + min(self._timeout, CLOSE_WAIT_S)
                    while self.store.add("closed", 0) < others and time.monotonic() < stop:
                        time.sleep(0.05)
            except RuntimeError:
                pass
            # the last references (-pi mpi's rank 0 keeps its server in _connect): its thread ends here
            self.store = self.launch_store = self._connect = None
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
        rank, world, local, connect = from_env(deadline, timeout_s)
    elif init_method == "tcp":
        if not server:
            raise UserError("-pi tcp needs -ps ADDRESS[:PORT], the host of rank 0 (e.g. -ps 10.0.0.1:29500)")
        (rank, world, local), (host, port) = by_hand(num_processes, process_rank, gpus_per_node), parse_server(server)
        connect = lambda: with_nonce(open_store(host, port, world, rank == 0, deadline, timeout_s), rank == 0)
    elif init_method == "fs":
        if not fs_path or not os.path.isdir(fs_path):
            raise UserError(f"-pf folder {fs_path} does not exist: create it on a filesystem all nodes share"
                            if fs_path else "-pi fs needs -pf FOLDER, a folder that all nodes share")
        rank, world, local = by_hand(num_processes, process_rank, gpus_per_node)
        connect = lambda: fs_store(fs_path, rank, world, deadline, timeout_s)
    elif init_method == "mpi":
        rank, world, local, connect = from_mpi(num_processes, process_rank, deadline, timeout_s)
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





# ---------------------------------------------------------------- the store









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
