"""A layout of a large model on one GPU, measured: `braidtrain train`'s flags run for a few steps
through braidtrain's own Trainer (as profile_step.py does), and no checkpoint written -- a run's
final checkpoint of llama3.1-8b (96 GB of weights and Adam moments) would not fit the GPU
machine's disk. Prints tokens/s and MFU over the steps after --warmup, the host's share of the
step, and the measured peak memory (metrics' mem_gb, torch's peak allocation) against the
planner's estimate of the same layout (plan/estimate.py's `allocated`; on the CPU the model state:
what `plan --check` compares); under --offload optimizer also the host peak (max RSS) and the host
update's seconds a step against the planner's host bytes and offload seconds.

    python benchmarks/speed/fit_gpu.py [--steps 6] [--warmup 3] [--json FILE] TRAIN_FLAGS ...
    e.g. python benchmarks/speed/fit_gpu.py --model llama3.1-8b -i DATA -b 2 -t 2048 -d 8192 --recompute --compile

One process; a layout of one GPU (tp, pp, cp = 1). The run directory (--out, default a temporary
folder) is removed at the end unless --out is given.
"""

import argparse
import dataclasses
import json
import resource
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain.options import Parser, train_config, train_parser  # noqa: E402
from braidtrain.plan.estimate import estimate  # noqa: E402
from braidtrain.plan.memory import GB  # noqa: E402
from braidtrain.plan.space import Candidate, Setup  # noqa: E402
from braidtrain.train import Trainer, gc_by_hand  # noqa: E402


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3, help="steps not timed (compilation, CUDA graph capture)")
    ap.add_argument("--json", help="also write the result here")
    a, flags = ap.parse_known_args(argv)
    assert a.steps > a.warmup >= 0, "--steps must exceed --warmup"
    cfg = train_config(train_parser(Parser().add_subparsers(parser_class=Parser)).parse_args(flags))
    tmp = None if cfg.out else tempfile.mkdtemp(prefix="braidtrain-fit-")
    cfg = dataclasses.replace(cfg, out=cfg.out or tmp, max_steps=a.steps, val_every=0, sample_tokens=0, progress=False,
                              save=False)
    trainer = Trainer(cfg)
    lay, cfg = trainer.layout, trainer.cfg  # (as resolved: --layout auto's choices)
    assert lay.tp == lay.pp == lay.cp == 1 and trainer.rt.world_size == 1, "one GPU: tp, pp, cp = 1, one process"
    try:
        with gc_by_hand():  # as in training: Python's collector does not strike inside the steps
            recs = [trainer.step(s) for s in range(a.steps)]
    finally:
        trainer.guard.close(clean=True)
        trainer.rt.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    timed = recs[a.warmup:]
    host_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB  # (Linux: KiB)
    offload_s = [r["offload_s"] for r in timed if "offload_s" in r]  # the host update's exposed part
    update_s = [r["offload_update_s"] for r in timed if "offload_update_s" in r]  # ... and its whole
    secs = sum(r["step_s"] for r in timed)
    tps = sum(r["tokens_per_s"] * r["step_s"] for r in timed) / secs
    mfu = timed[0]["mfu"] and timed[0]["mfu"] / timed[0]["tokens_per_s"] * tps
    gpu_gb = torch.cuda.get_device_properties(0).total_memory / GB if torch.cuda.is_available() else 0.0
    setup = Setup(trainer.mcfg, 1, gpu_gb, cfg.seq_len, lay.batch.total_tokens, bucket_mb=cfg.bucket_mb,
                  cpu=trainer.device.type == "cpu", fp8=cfg.fp8, compile=cfg.compile)
    candidate = Candidate(dp=1, zero=cfg.zero, b=cfg.batch_size, recompute=cfg.recompute,
                          offload=cfg.offload == "optimizer", ratio=lay.offload_ratio)
    e = estimate(setup, candidate)
    st = e["state"]  # on the CPU mem_gb is the model state between steps (plan/check.py compares the same)
    est = (st["params"] + st["grads"] + st["optimizer"] - st["transient"] if setup.cpu else e["allocated"]) / GB
    peak = max(r["mem_gb"] for r in recs)
    out = {"model": cfg.model, "layout": candidate.name() + (" --compile" if cfg.compile else "")
           + (" --cuda-graph" if cfg.cuda_graph else ""), "tokens_per_s": tps, "mfu": mfu, "mem_gb": peak,
           "estimated_gb": est, "rel_error": (est - peak) / peak, "host_frac": sum(r["host_s"] for r in timed) / secs,
           "loss": recs[-1]["loss"], "steps": a.steps, "warmup": a.warmup, "host_peak_gb": host_gb,
           "step_s": secs / len(timed), "offload_s": sum(offload_s) / len(offload_s) if offload_s else None,
           "planned_host_gb": e["host"] / GB, "planned_offload_s": e["offload_s"], "planned_step_s": e["step_s"],
           "offload_update_s": sum(update_s) / len(update_s) if update_s else None}
    if a.json:  # (first: a figure missing from the line below loses nothing)
        Path(a.json).write_text(json.dumps(out) + "\n")
    print(json.dumps(out), flush=True)  # (whatever the line below makes of it)
    mfu_text = "-" if mfu is None else f"{100 * mfu:.1f}%"
    print(f"{out['model']} {out['layout']} -t {cfg.seq_len} -d {lay.batch.total_tokens}: {tps:,.0f} tokens/s, MFU "
          f"{mfu_text}, host {100 * out['host_frac']:.0f}% of the step; peak {peak:.2f} GB measured, {est:.2f} GB "
          f"estimated by plan ({100 * out['rel_error']:+.1f}%); loss {out['loss']:.4f}; host peak {host_gb:.1f} GB; "
          f"step {out['step_s']:.2f} s" + (f", host update {out['offload_update_s']:.2f} s, {out['offload_s']:.2f} s of "
                                           f"it exposed (planned: host {out['planned_host_gb']:.1f} GB, "
                                           f"{e['offload_s']:.2f} s)" if offload_s else ""),
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
