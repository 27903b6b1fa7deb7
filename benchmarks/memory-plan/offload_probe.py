"""The rates --offload optimizer's time depends on, measured on this machine, for plan/timing.py:
the host's fused AdamW (torch.optim.AdamW(fused=True) on CPU tensors, every core) in elements a
second -- HOST_ADAM_PPS -- and pinned copies between the GPU and the host in GB/s each way --
PCIE_D2H_GBPS (the gradients down), PCIE_H2D_GBPS (the weights up). Beside them the host's own
memory bandwidth (a large copy), which bounds the update: AdamW reads the weight, gradient, m and
v and writes the weight, m and v, 28 bytes an fp32 element, so the update's GB/s over the copy's
says how close to the memory's limit it runs.

    python benchmarks/memory-plan/offload_probe.py [--elements 268435456] [--json FILE]
    python benchmarks/memory-plan/offload_probe.py --loop [--buckets 8 --bucket-elements 218103808]

On a machine without a GPU the copies are left out (the update and the copy still measured). Each
figure is the best of --repeat timed runs after one untimed.

--loop: where the offloaded update loses against the bare kernel -- the worker's loop of
parallel/offload.py (_work) mimicked on synthetic buckets (default: eight of llama3.1-8b's block
size), in a worker thread as there, each factor added one at a time and timed over all buckets:
the fused AdamW alone; the weight decay's separate pass (optim.AdamW.apply's _foreach_mul_); the
conversion of the master to bf16 into a pinned slot; the whole loop with its copies (on a GPU:
gradients down into S = 4 pinned slots and weights up on one side stream, with the worker's
waits); the loop with the OpenMP team one or two threads short of the cores; the loop while the
main thread keeps a core busy (as it does launching the next forward, or spinning in a CUDA
synchronisation); the loop with the decay inside the fused kernel (weight_decay on the decayed
ranges' call), and with the master's rounding to bf16 on the GPU (fp32 up into a device slot:
offload.py since 2026-12-03). G elements/s each.
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain.optim import spans  # noqa: E402


def best(fn, repeat: int, sync=lambda: None) -> float:
    """The fastest of `repeat` timed calls of fn, after one untimed (first touch, thread start)."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


class Loop:
    """Synthetic buckets as the offload worker holds them (module docstring, --loop)."""

    def __init__(self, buckets: int, n: int, slots: int = 4):
        cuda = torch.cuda.is_available()
        self.cuda, self.n, self.s = cuda, n, slots
        self.master = [torch.empty(n, pin_memory=cuda).fill_(0.01) for _ in range(buckets)]
        self.m = [torch.zeros(n) for _ in range(buckets)]
        self.v = [torch.zeros(n) for _ in range(buckets)]
        # a block's 2-D weights, decayed (seven matrices; the rest, norms, not)
        cut = [i * (n - 8192) // 7 for i in range(8)]
        self.decay = list(zip(cut[:-1], cut[1:]))
        self.slots = [torch.empty(n, pin_memory=cuda).fill_(1e-3) for _ in range(slots)]
        self.up = [torch.empty(n, dtype=torch.bfloat16, pin_memory=cuda) for _ in range(slots)]
        dev = "cuda" if cuda else "cpu"
        self.grads = [torch.full((n,), 1e-3, device=dev) for _ in range(buckets)] if cuda else None
        self.weights = [torch.empty(n, dtype=torch.bfloat16, device=dev) for _ in range(buckets)] if cuda else None
        self.staging = torch.empty(n, device=dev) if cuda else None
        self.stream = torch.cuda.Stream() if cuda else None
        self.scale, self.flag = torch.ones(()), torch.zeros(())
        self.lr, self.keep, self.step = torch.tensor(1e-4), torch.tensor(1 - 1e-5), torch.tensor(1.0)

    def _copy(self, dst, src):
        if self.stream is None:
            return None
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return done

    def run(self, decay=True, convert="host", copies=True, fold=False) -> None:
        """One pass of the worker's loop over every bucket (parallel/offload.py's _work). convert:
        "host" (the master rounded to bf16 into a pinned slot, 2 bytes an element up, as before
        2026-12-03's fix), "gpu" (fp32 up into a device slot, rounded there: offload.py now) or None."""
        nb, s = len(self.master), self.s
        copied, arrived = [None] * nb, [None] * nb
        copies = copies and self.cuda
        if copies:
            self.stream.wait_stream(torch.cuda.current_stream())
            for i in range(min(s, nb)):
                copied[i] = self._copy(self.slots[i], self.grads[i])
        for k in range(nb):
            if copied[k] is not None:
                copied[k].synchronize()
            if copies and convert == "host" and k >= s and arrived[k - s] is not None:
                arrived[k - s].synchronize()
            p, g, up = self.master[k], self.slots[k % s], self.up[k % s]
            if decay and not fold:
                torch._foreach_mul_([p[a:e] for a, e in self.decay], self.keep)
            # fold: the decay inside the kernel, the decayed ranges in one call, the rest in another
            rest = [(a, e) for a, e, decayed in spans(self.decay, self.n) if not decayed]
            for wd, ranges in ((0.1, self.decay), (0.0, rest)) if fold else ((0.0, [(0, self.n)]),):
                torch._fused_adamw_([p[a:e] for a, e in ranges], [g[a:e] for a, e in ranges],
                                    [self.m[k][a:e] for a, e in ranges], [self.v[k][a:e] for a, e in ranges],
                                    [], [self.step] * len(ranges), lr=self.lr, beta1=0.9, beta2=0.95,
                                    weight_decay=wd, eps=1e-8, amsgrad=False, maximize=False,
                                    grad_scale=self.scale, found_inf=self.flag)
            if convert == "host":
                up.copy_(p)
            if copies and convert == "gpu":
                with torch.cuda.stream(self.stream):
                    self.staging.copy_(p, non_blocking=True)
                    self.weights[k].copy_(self.staging)
                    arrived[k] = torch.cuda.Event()
                    arrived[k].record()
            elif copies and convert == "host":
                arrived[k] = self._copy(self.weights[k], up)
            if copies and k + s < nb:
                copied[k + s] = self._copy(self.slots[(k + s) % s], self.grads[k + s])
        if copies:
            self.stream.synchronize()


def in_worker(fn, threads: int, busy: bool = False):
    """fn() on a thread of its own with an OpenMP team of `threads` (as offload.py's worker); `busy`:
    the main thread keeps one core busy meanwhile (single-threaded matmuls, the GIL released)."""
    out = {}

    def work():
        torch.set_num_threads(threads)
        out["s"] = best(fn, 1)

    t = threading.Thread(target=work)
    t.start()
    if busy:
        keep = torch.get_num_threads()
        torch.set_num_threads(1)
        a = torch.randn(256, 256)
        while t.is_alive():
            a @ a
        torch.set_num_threads(keep)
    t.join()
    return out["s"]


def loop(a) -> dict:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    L = Loop(a.buckets, a.bucket_elements)
    total = a.buckets * a.bucket_elements
    rows = [("adam", dict(decay=False, convert=None, copies=False), cores, False),
            ("loop", {}, cores, False),
            ("loop, main busy", {}, cores, True),
            (f"loop, {cores - 1} threads, main busy", {}, max(1, cores - 1), True)]
    rows += [("loop, decay in kernel", dict(fold=True), cores, False),
             ("loop, decay in kernel, rounded on the GPU", dict(fold=True, convert="gpu"), cores, False)]
    rows += [("adam+decay", dict(convert=None, copies=False), cores, False),
             ("adam+decay+bf16", dict(copies=False), cores, False),
             ("adam+bf16", dict(decay=False, copies=False), cores, False),
             (f"loop, {cores - 1} threads", {}, max(1, cores - 1), False)]
    out = {"cores": cores, "buckets": a.buckets, "bucket_elements": a.bucket_elements}
    print(f"loop: {a.buckets} buckets of {a.bucket_elements / 1e6:.0f} M elements, {cores} cores"
          f"{', copies on the GPU' if L.cuda else ''}", flush=True)
    for name, kw, threads, busy in rows:
        sec = in_worker(lambda kw=kw: L.run(**kw), threads, busy)
        out[name] = total / sec
        print(f"  {name:<44}{total / sec / 1e9:6.2f} G elements/s  ({sec:.3f} s)", flush=True)
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 28, help="fp32 elements of the update (default 256 Mi: 1 GiB "
                                                                  "a tensor) and of the copies")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--loop", action="store_true", help="the worker loop's factors (module docstring) instead")
    ap.add_argument("--buckets", type=int, default=8)
    ap.add_argument("--bucket-elements", type=int, default=218_103_808, help="default: llama3.1-8b's block")
    a = ap.parse_args(argv)
    if a.loop:
        out = loop(a)
        if a.json:
            Path(a.json).write_text(json.dumps(out) + "\n")
        return
    torch.set_num_threads(os.cpu_count())  # every core, as the offloaded update runs
    n = a.elements
    p, g = torch.randn(n), torch.randn(n) * 1e-3
    p.grad = g
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, fused=True)
    adam_s = best(opt.step, a.repeat)
    src, dst = torch.empty(n), torch.empty(n)
    src.fill_(1.0)
    copy_s = best(lambda: dst.copy_(src), a.repeat)
    out = {"threads": torch.get_num_threads(), "elements": n, "host_adam_pps": n / adam_s,
           "host_copy_GBps": 2 * 4 * n / copy_s / 1e9,  # read + write
           "adam_GBps": 28 * n / adam_s / 1e9}
    out["adam_of_copy"] = out["adam_GBps"] / out["host_copy_GBps"]
    p = g = opt = src = dst = None  # (the host memory back before the copies)
    if torch.cuda.is_available():
        dev = torch.empty(n, device="cuda")
        host = torch.empty(n, pin_memory=True)
        sync = torch.cuda.synchronize
        out["pcie_d2h_GBps"] = 4 * n / best(lambda: host.copy_(dev, non_blocking=True), a.repeat, sync) / 1e9
        out["pcie_h2d_GBps"] = 4 * n / best(lambda: dev.copy_(host, non_blocking=True), a.repeat, sync) / 1e9
    say = (f"probe: fused CPU AdamW {out['host_adam_pps'] / 1e9:.2f} G elements/s on {out['threads']} threads "
           f"({out['adam_GBps']:.1f} GB/s of state, {100 * out['adam_of_copy']:.0f}% of a host copy's "
           f"{out['host_copy_GBps']:.1f} GB/s)")
    if "pcie_d2h_GBps" in out:
        say += f"; pinned copies D2H {out['pcie_d2h_GBps']:.1f} GB/s, H2D {out['pcie_h2d_GBps']:.1f} GB/s"
        say += (f"\n  plan/timing.py: HOST_ADAM_PPS = {out['host_adam_pps']:.3g}, PCIE_D2H_GBPS = "
                f"{out['pcie_d2h_GBps']:.1f}, PCIE_H2D_GBPS = {out['pcie_h2d_GBps']:.1f}")
    print(say, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
