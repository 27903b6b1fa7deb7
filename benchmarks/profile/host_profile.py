"""Where a host-bound training step's Python time goes: cProfile around steps of braidtrain's trainer.

    python benchmarks/profile/host_profile.py [train flags ...]     # from the repo root, one GPU
    e.g. python benchmarks/profile/host_profile.py --model gpt2 -i data/shakespeare_gpt2 -b 16 -t 1024 -d 131072 --compile --exact

Runs 4 steps to warm up, then 3 under cProfile (which slows Python down, so the figures are
shares, not times), and prints the functions by their own time and by cumulative time, with
their calls a step: the call counts say which loops run per bucket, per block or per micro-step.
profile_step.py says what the GPU does meanwhile.
"""

import cProfile
import dataclasses
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain.options import Parser, train_config, train_parser  # noqa: E402
from braidtrain.train import Trainer, gc_by_hand  # noqa: E402

STEPS = 3


def main(argv):
    cfg = train_config(train_parser(Parser().add_subparsers(parser_class=Parser)).parse_args(argv))
    cfg = dataclasses.replace(cfg, max_steps=4 + 2 * STEPS, val_every=0, sample_tokens=0, progress=False)
    trainer = Trainer(cfg)
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    with gc_by_hand():
        for s in range(4):
            trainer.step(s)
        sync()
        t0 = time.time()
        for s in range(4, 4 + STEPS):
            trainer.step(s)
        sync()
        plain = (time.time() - t0) / STEPS
        prof = cProfile.Profile()
        t0 = time.time()
        prof.enable()
        for s in range(4 + STEPS, 4 + 2 * STEPS):
            trainer.step(s)
        sync()
        prof.disable()
        profiled = (time.time() - t0) / STEPS
    print(f"step {plain * 1e3:.1f} ms wall, {profiled * 1e3:.1f} ms under cProfile; calls below are per step")
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats(key).print_stats(45)
        print(f"--- by {key} (all {STEPS} steps) ---")
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[-9000:])
    trainer.guard.close(clean=True)
    trainer.rt.close()


if __name__ == "__main__":
    main(sys.argv[1:])
