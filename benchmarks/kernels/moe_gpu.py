"""A mixture of experts on one GPU (issue #21): gpt2-moe (gpt2, 8 experts of the MLP's shape in
every block, top-2) at ep 1 -- the experts as one grouped GEMM (torch._grouped_mm) against a
per-expert loop, and what capacity drops.

    python benchmarks/kernels/moe_gpu.py --data data/shakespeare_gpt2     # from the repo root; a few minutes

1. One MoE layer (16k tokens of gpt2's width, bf16): forward+backward time with the grouped GEMM
   and with the loop, and whether their outputs and gradients are the same bits.
2. The whole model's training step: `braidtrain train --config gpt2-moe -b 8 -t 1024 -d 65536 -x 8`
   dropless and at --moe-capacity 1.25 (tokens/s, MFU on the active parameters, peak memory,
   moe_dropped), and the same with the loop (BRAIDTRAIN_MOE_LOOP=1 makes this script's own
   train runs set Dispatch.grouped = False; nothing else reads it).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain.model.registry import model_config  # noqa: E402
from braidtrain.model.moe import MoE  # noqa: E402
from braidtrain.parallel.expert import Dispatch  # noqa: E402


def layer(tokens=16384):
    from triton.testing import do_bench

    cfg = model_config("gpt2", 50257, moe_experts=8, moe_top_k=2)
    torch.manual_seed(0)
    moe = MoE(cfg, range(8), Dispatch()).cuda()
    x = torch.randn(tokens, 768, device="cuda")
    dy = torch.randn(tokens, 768, device="cuda")
    out = {}
    for grouped in (True, False):
        moe.dispatch.grouped = grouped

        def step():
            xx = x.detach().requires_grad_()
            with torch.autocast("cuda", torch.bfloat16):
                y = moe(xx)
            g = torch.autograd.grad(y, [xx, *moe.parameters()], dy)
            return y, g
        y, g = step()
        ms = do_bench(step, warmup=5, rep=100)
        out[grouped] = (y.detach(), [t.detach() for t in g], ms)
    same = torch.equal(out[True][0], out[False][0]) and all(torch.equal(a, b) for a, b in zip(out[True][1], out[False][1]))
    flops = 3 * 2 * tokens * 2 * (2 * 768 * 3072)  # fwd + bwd, k = 2 experts a token, two matmuls
    for grouped in (True, False):
        ms = out[grouped][2]
        print(f"| {'grouped GEMM' if grouped else 'per-expert loop'} | {ms:.3f} | {flops / ms / 1e9:.0f} |")
    print(f"outputs and gradients the same bits: {same}")


def train(data, extra, loop=False):
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, **({"BRAIDTRAIN_MOE_LOOP": "1"} if loop else {})}
        cmd = [sys.executable, __file__, "--_train", "--config", "gpt2-moe", "-i", data, "-b", "8", "-t", "1024",
               "-d", "65536", "-x", "8", "--val-every", "0", "--sample-tokens", "0", "--no-progress",
               "--ckpt-every", "0", "--val-steps", "1", "--out", out, *extra]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        rows = [json.loads(x) for x in Path(out, "metrics.jsonl").read_text().splitlines()] if p.returncode == 0 else []
        rows = [r for r in rows if "tokens_per_s" in r]
        if not rows:
            print(f"| {' '.join(extra) or 'dropless'} | {'loop' if loop else 'grouped'} | failed: "
                  f"{(p.stderr.strip().splitlines() or ['?'])[-1][:150]} |")
            return
        r = rows[-1]
        print(f"| {' '.join(extra) or 'dropless'} | {'loop' if loop else 'grouped'} | {r['tokens_per_s']:,.0f} | "
              f"{100 * r['mfu']:.1f}% | {r['mem_gb']:.1f} | {r['moe_dropped']:.4f} | {r['moe_load_max']:.2f} | "
              f"{r['loss']:.4f} |",
              flush=True)


if __name__ == "__main__":
    if "--_train" in sys.argv:  # one training run, the experts' loop if asked (see the docstring)
        sys.argv.remove("--_train")
        if os.environ.get("BRAIDTRAIN_MOE_LOOP"):
            import braidtrain.parallel.expert as expert

            init = expert.Dispatch.__init__

            def looping(self, *a, **k):
                init(self, *a, **k)
                self.grouped = False
            expert.Dispatch.__init__ = looping
        from braidtrain.cli import run
        sys.argv = ["braidtrain", "train", *sys.argv[1:]]
        run()
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/shakespeare_gpt2")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print("| experts | fwd+bwd ms | TFLOP/s |\n|---|---|---|")
    layer()
    print("| flags | experts | tokens/s | MFU (active) | peak GB | dropped | load max/mean | loss at step 8 |")
    print("|---|---|---|---|---|---|---|---|")
    for extra in ([], ["--moe-capacity", "1.25"]):
        train(a.data, extra)
    train(a.data, [], loop=True)
