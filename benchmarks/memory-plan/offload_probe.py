"""The rates --offload optimizer's time depends on, measured on this machine, for plan/timing.py:
the host's fused AdamW (torch.optim.AdamW(fused=True) on CPU tensors, every core) in elements a
second -- HOST_ADAM_PPS -- and pinned copies between the GPU and the host in GB/s each way --
PCIE_D2H_GBPS (the gradients down), PCIE_H2D_GBPS (the weights up). Beside them the host's own
memory bandwidth (a large copy), which bounds the update: AdamW reads the weight, gradient, m and
v and writes the weight, m and v, 28 bytes an fp32 element, so the update's GB/s over the copy's
says how close to the memory's limit it runs.

    python benchmarks/memory-plan/offload_probe.py [--elements 268435456] [--json FILE]

On a machine without a GPU the copies are left out (the update and the copy still measured). Each
figure is the best of --repeat timed runs after one untimed.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


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


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, default=1 << 28, help="fp32 elements of the update (default 256 Mi: 1 GiB "
                                                                  "a tensor) and of the copies")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args(argv)
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
