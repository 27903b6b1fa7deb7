"""A run directory belongs to one run.

    RUN/run.json    {"id": ..., "started": ...}: which run this directory holds; every checkpoint's
                    meta.json records the same id, and rotation deletes only that run's checkpoints
    RUN/.lock       held (flock) by the run's rank 0 while it runs: a second run into the same
                    directory at the same time stops at once, in one line

A new run (no --resume, not a torchrun restart) into a directory that holds another run's metrics
or checkpoints stops before training, in one line: continue it with --resume auto, or start over
there with --start-over, which first moves that run's files aside to RUN.replaced-<time>/ (nothing
is deleted). --resume continues the run the directory holds: it keeps its id.

Why the lock: two runs writing into one directory at once -- a run started while an earlier one
still saves -- delete each other's checkpoints in progress (each save's rotation cleared every
unfinished `step_*.tmp` folder), and one of them fails with "could not write checkpoint ...: No
such file or directory" (docs/fault-tolerance.md).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import time
import uuid
from datetime import datetime
from pathlib import Path

from braidtrain.errors import UserError

RUN_FILE, LOCK_FILE = "run.json", ".lock"


def held_by_a_run(out: Path) -> list[str]:
    """What of a run `out` holds: its metrics, summary and checkpoints (finished or not). A run
    that failed before its first step left no metrics line: its run.json, config.toml and flight
    logs do not make the directory another run's, so the corrected command may use it."""
    metrics = out / "metrics.jsonl"
    found = ["metrics.jsonl"] if metrics.is_file() and metrics.stat().st_size else []
    found += [name for name in ("summary.json",) if (out / name).is_file()]
    steps = sorted(p.name for p in (out / "checkpoints").glob("step_*")) if (out / "checkpoints").is_dir() else []
    return found + (["checkpoints "
                     f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else f"checkpoint {steps[0]}"] if steps else [])


def lock(out: Path) -> int:
    """Hold RUN/.lock for this process's life (the file descriptor stays open); one line if another
    process holds it."""
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise UserError(f"{out} is in use by another run ({who}): wait for it to end, or give another --out") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


def move_aside(out: Path) -> Path:
    """Every entry of `out` but the lock, into a new sibling folder OUT.replaced-<time>."""
    aside = out.with_name(f"{out.name}.replaced-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    aside.mkdir()
    for entry in out.iterdir():
        if entry.name != LOCK_FILE:
            os.rename(entry, aside / entry.name)
    return aside


def claim(out: Path, resume: bool, start_over: bool, log) -> tuple[str, int]:
    """Rank 0's claim on the run directory, before training: (this run's id, the lock's descriptor)."""
    out.mkdir(parents=True, exist_ok=True)
    fd = lock(out)
    try:
        held = held_by_a_run(out)
        if resume:  # the run this directory holds goes on (one from before run.json: adopted)
            try:
                return json.loads((out / RUN_FILE).read_text())["id"], fd
            except (OSError, ValueError, KeyError):
                pass
        elif held and not start_over:
            raise UserError(f"{out} holds another run ({', '.join(held)}): continue it with --resume auto, start "
                            f"over there with --start-over (its files move aside first), or give another --out")
        elif held:
            log(f"--start-over: the previous run's files in {out} moved to {move_aside(out)}")
        run_id = uuid.uuid4().hex
        tmp = out / f".{RUN_FILE}.tmp"
        tmp.write_text(json.dumps({"id": run_id, "started": time.time()}) + "\n")
        os.replace(tmp, out / RUN_FILE)
        return run_id, fd
    except BaseException:
        os.close(fd)
        raise


def space_warning(out: Path, size: int, copies: int, keep: int) -> str | None:
    """One line when the free space under `out` cannot hold `copies` more checkpoints of `size`
    bytes (what a run keeps at once: --keep-ckpts, and one more while a save replaces the oldest)."""
    free = shutil.disk_usage(out).free
    if copies * size <= free:
        return None
    return (f"warning: the checkpoints this run keeps need {_size(copies * size)} under {out} ({copies} x "
            f"{_size(size)}; --keep-ckpts {keep}) and {_size(free)} are free: the save would fail then; free "
            f"space, give --out on a larger disk, lower --keep-ckpts, or --no-save")


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
