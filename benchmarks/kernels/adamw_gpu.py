"""Default mode's update on a GPU in one pass (optim.AdamW.one_pass: parallel/exact_kernels.py's adamw --
the decay on the 2-D weights' ranges, AdamW, the bf16 compute weights) against the path it replaces
(`_foreach_mul_` decay, `torch._fused_adamw_`, publish()'s `copy_` to bf16): both through
optim.AdamW.update on lean buckets laid out as Llama-3.2-1B's 1.24 B parameters (its 2-D weights
decayed, its norms not), cut into --shards shards.

    python benchmarks/kernels/adamw_gpu.py [--shards 4] [--json PATH]          # one H200: ~30 s
    TRITON_INTERPRET=1 python benchmarks/kernels/adamw_gpu.py --device cpu      # the CPU check: a small model

1. One step of each from the same state (grad_scale 1.3): the largest difference of p, m, v relative
   to the size of the step's terms (the value before and after), the bf16 weights' largest distance
   in ulps, and how many elements differ at all. Then on the first shard, bit for bit: the kernel
   against exact mode's torch path there (the decay, exact_kernels.exact_adamw, copy_: the same
   operations, so 0 must differ), and the kernel writing no compute weights (live recovery's buddy
   copy, parallel/mirror.py) against the kernel writing them (0 must differ in p, m, v).
2. Time (CUDA events, the median of 5 steps after a warm one) of each update, and GB/s against the
   bytes each moves: the torch path 8 a decayed element (the decay's read and write of p) + 32 (fused
   AdamW: p, g, m, v read, p, m, v written, and g / grad_scale written back into g) + 6 (publish: p
   read, bf16 written); the kernel 30 (it leaves g as it was).
Prints one line per finding; --json PATH writes them.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain import optim  # noqa: E402
from braidtrain.parallel import exact_kernels, master  # noqa: E402

LLAMA_1B = dict(d=2048, layers=16, vocab=128_256, ffn=8192, kv=512)
SMALL = dict(d=64, layers=2, vocab=1000, ffn=256, kv=16)  # --device cpu (interpreted: slow)


def parameters(d, layers, vocab, ffn, kv):
    """(numel, decayed) in Llama's order: the (tied) embedding, each layer's norms and matrices, the final norm."""
    block = [(d, False), (d * d, True), (kv * d, True), (kv * d, True), (d * d, True), (d, False),
             (ffn * d, True), (ffn * d, True), (ffn * d, True)]
    return [(vocab * d, True), *block * layers, (d, False)]


class Engine:
    """The optimizer's view of an engine: `shards` lean buckets (fp32 master, bf16 compute weights)."""

    def __init__(self, params, shards, device, exact=False):
        total = sum(n for n, _ in params)
        cuts = [i * total // shards // 64 * 64 for i in range(shards)] + [total]
        decay, at = [], 0  # the decayed ranges over the whole
        for n, decayed in params:
            if decayed:
                decay.append((at, at + n))
            at += n
        self.device, self.exact, self.buckets = device, exact, []
        gen = torch.Generator(device=device).manual_seed(0)
        for a, e in zip(cuts, cuts[1:]):
            p = torch.randn(e - a, device=device, generator=gen)
            mine = [(max(s, a) - a, min(t, e) - a) for s, t in decay if max(s, a) < min(t, e)]
            self.buckets.append(SimpleNamespace(master=p, grad=torch.zeros_like(p), decay=mine, apart=True,
                                                data=p.to(torch.bfloat16)))
            self.buckets[-1].compute_shard = lambda b=self.buckets[-1]: b.data
        self.numel, self.decayed = total, sum(e - a for b in self.buckets for a, e in b.decay)

    def owned(self):
        return ((b, b.master, b.grad) for b in self.buckets)

    def decay_segments(self, b):
        return b.decay

    def publish(self, buckets):
        master.publish(buckets)


def optimizer(engine, one_pass):
    opt = optim.AdamW(engine, weight_decay=0.1)
    opt.one_pass = lambda t: one_pass  # (on CPU tensors too: TRITON_INTERPRET=1)
    return opt


def state(engine, opt):
    return [(b.master, m, v, b.data) for b, (m, v, _) in zip(engine.buckets, opt.groups)]


def copy_state(dst, src):
    for a, b in zip(dst, src):
        for x, y in zip(a, b):
            x.copy_(y)


def differ(a, b):
    return int((a.view(torch.int16) != b.view(torch.int16)).sum())


def check(params, shards, device, out):
    """Part 1: one step each from the same state."""
    old, new = Engine(params, shards, device), Engine(params, shards, device)
    o_old, o_new = optimizer(old, False), optimizer(new, True)
    gen = torch.Generator(device=device).manual_seed(1)
    for b in old.buckets:
        b.grad.normal_(generator=gen)
        b.master.mul_(0.05)  # a trained model's scale: the update is not lost below p's ulp
        b.data.copy_(b.master)
    for _, m, v, _ in state(old, o_old):  # the moments of a run under way
        m.normal_(generator=gen).mul_(1e-3)
        v.uniform_(generator=gen).mul_(1e-6)
    copy_state(state(new, o_new), state(old, o_old))
    for a, b in zip(new.buckets, old.buckets):
        a.grad.copy_(b.grad)
    start = [[t.clone() for t in s[:3]] for s in state(old, o_old)]
    scale = torch.tensor(1.3, device=device)
    for opt in (o_old, o_new):
        opt.prepare(3e-4)
        opt.update(scale, None)
    worst, ulps, bits = {"p": 0.0, "m": 0.0, "v": 0.0}, 0, 0
    for was, a, b in zip(start, state(new, o_new), state(old, o_old)):
        for name, w, x, y in zip("pmv", was, a, b):
            rel = ((x - y).abs() / torch.maximum(y.abs(), w.abs())).nan_to_num(0.0).max()
            worst[name] = max(worst[name], float(rel))
            bits += differ(x, y)
        ulps = max(ulps, int(((a[3].float().view(torch.int32) >> 16) - (b[3].float().view(torch.int32) >> 16)).abs().max()))
        bits += differ(a[3], b[3])
    for name, rel in worst.items():
        out[f"one step against the torch path: {name}'s largest relative difference"] = f"{rel:.3g}"
    out["one step against the torch path: the bf16 weights' largest distance, ulps"] = ulps
    out[f"one step against the torch path: elements differing of {4 * old.numel:,} (p, m, v, bf16)"] = bits
    # exact mode's torch path on the first shard, from the same start; and the kernel without compute weights
    b0 = new.buckets[0]
    n0 = b0.master.numel()
    ref = [t.clone() for t in start[0]]
    _, _, keep, c1, c2 = o_new.scalars[device.type]
    torch._foreach_mul_([ref[0][a:e] for a, e in b0.decay], keep)
    exact = exact_kernels.exact_adamw if device.type == "cuda" else optim.exact_adamw
    exact(*ref[:1], b0.grad, *ref[1:], 0.9, 0.95, 1e-8, c1, c2, scale)
    mine = [t.clone() for t in start[0]]
    out_bf16 = torch.empty(n0, dtype=torch.bfloat16, device=device)
    exact_kernels.adamw(*mine[:1], b0.grad, *mine[1:], o_new.decay_table(mine[0], b0.decay), out_bf16, keep, c1, c2,
                        0.9, 0.95, 1e-8, scale)
    out[f"first shard, the kernel against exact mode's torch path: elements differing of {4 * n0:,}"] = (
        sum(differ(x, y) for x, y in zip(mine, ref)) + differ(out_bf16, ref[0].to(torch.bfloat16)))
    alone = [t.clone() for t in start[0]]
    exact_kernels.adamw(*alone[:1], b0.grad, *alone[1:], o_new.decay_table(alone[0], b0.decay), None, keep, c1, c2,
                        0.9, 0.95, 1e-8, scale)
    out[f"first shard, the kernel without compute weights against with: elements differing of {3 * n0:,}"] = sum(
        differ(x, y) for x, y in zip(alone, mine))
    return old, o_old, new, o_new


def timing(old, o_old, new, o_new, out):
    """Part 2: each update's time on the states part 1 left."""
    from kernel_probe_gpu import timed  # (this folder is sys.path[0]: a sibling script)

    scale = torch.tensor(1.3, device="cuda")
    moved = {"torch path (foreach_mul + _fused_adamw_ + copy_)": 8 * old.decayed + 38 * old.numel,
             "one kernel (exact_kernels.adamw)": 30 * new.numel}
    for (name, nbytes), (opt, engine) in zip(moved.items(), ((o_old, old), (o_new, new))):
        for b in engine.buckets:
            b.grad.normal_()
        ms = timed(lambda opt=opt: (opt.prepare(3e-4), opt.update(scale, None)), rounds=5, warm=1)
        out[f"{name} over {engine.numel:,} elements in {len(engine.buckets)} shards, ms"] = round(ms, 2)
        out[f"{name}: GB/s of the {nbytes / engine.numel:.1f} bytes an element it moves"] = round(nbytes / ms / 1e6, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1", "--device cpu runs the kernel interpreted: TRITON_INTERPRET=1"
    else:
        print(torch.cuda.get_device_name(), "torch", torch.__version__)
    out = {}
    parts = check(parameters(**(LLAMA_1B if device.type == "cuda" else SMALL)), a.shards, device, out)
    if device.type == "cuda":
        timing(*parts, out)
    for k, v in out.items():
        print(f"{k}: {v}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
