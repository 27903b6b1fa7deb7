"""The tests' process server (helpers.launch): it imports torch and braidtrain once, then forks one
process per request -- `python -m MODULE ARGS` or `python SCRIPT ARGS`, run by runpy with the
request's argv, environment, folder and stdout/stderr files -- and answers with the process id,
then, once the process has ended, its exit code (negative: the signal that ended it).

argv: the Unix socket to listen on. It prints "ready" once listening, and ends with its parent.
One thread, no threads started by what it imports: each fork copies only the server itself."""

import json
import os
import runpy
import selectors
import signal
import socket
import sys
import traceback
from pathlib import Path

PRELOAD = ["torch", "torch.distributed", "numpy", "braidtrain.cli", "braidtrain.train", "braidtrain.live",
           "braidtrain.bench.train", "braidtrain.plan.command", "braidtrain.io.data", "braidtrain.evaluate",
           "braidtrain.io.export", "braidtrain.io.metrics",
           "torch._dynamo", "torch._inductor.utils"]  # (braidtrain imports them on first use: compile, exact kernels)


def child(req: dict) -> None:
    """In the forked process: the request's program; its exit code the process's."""
    os.setsid()  # its own process group: nothing it starts outlives a kill of the group
    os.environ.clear()
    os.environ.update(req["env"])
    # its PYTHONPATH's folders on sys.path, as a fresh interpreter puts them (after the script's own)
    sys.path[1:1] = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    os.chdir(req["cwd"])
    for fd, path in ((1, req["out"]), (2, req["err"])):  # appended to, as ranks share torchrun's stdout
        f = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    if req.get("fsize") is not None:  # a write past the limit then fails with EFBIG (SIGXFSZ ignored, not fatal)
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))
    target, code = req["target"], 1
    try:
        if target[0] == "-m":
            sys.argv = target[1:]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(target)
            sys.path.insert(0, str(Path(target[0]).resolve().parent))
            runpy.run_path(target[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(path: str) -> None:
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    waiting = {}  # pid -> its requester's connection
    print("ready", flush=True)
    while os.getppid() == parent:
        for _key, _ in sel.select(timeout=0.05):
            conn, _ = listener.accept()
            with conn.makefile("r") as f:
                req = json.loads(f.readline())
            pid = os.fork()
            if pid == 0:  # none of the server's sockets stays open in the child
                sel.close()
                for c in (listener, conn, *waiting.values()):
                    c.close()
                child(req)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the requester is gone
                conn.close()


if __name__ == "__main__":
    for name in PRELOAD:
        __import__(name)
    serve(sys.argv[1])
