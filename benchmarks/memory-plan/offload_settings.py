"""The host update's own speed inside a run, under several settings of the worker, in ONE process
(one model build, one compilation): `braidtrain train`'s flags run through the Trainer, --warmup
steps, then --steps steps under each setting THREADS:FOLD -- the worker's OpenMP team
(BRAIDTRAIN_HOST_THREADS; 0: offload.py's own choice) and whether default mode's weight decay is
done inside the fused kernel (Offload.fold: 1, as in a run; 0: a pass of its own, as before
2026-12-03). (At 0c4c21a a second field was the chunk a bucket's update took at a time: gone since.)
Prints, per setting, the step's seconds, the host update's seconds (offload_update_s) and its rate
in elements a second, and how much of it stayed exposed (offload_s). No checkpoint is written.

    python benchmarks/memory-plan/offload_settings.py --settings 16:0,16:1 TRAIN_FLAGS ...
"""

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain.options import Parser, train_config, train_parser  # noqa: E402
from braidtrain.train import Trainer, gc_by_hand  # noqa: E402


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--settings", required=True, help="THREADS:FOLD,... (THREADS 0: offload.py's own choice)")
    ap.add_argument("--steps", type=int, default=2, help="steps timed under each setting")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", help="also write the rows here")
    a, flags = ap.parse_known_args(argv)
    settings = [tuple(int(x) for x in (s + ":1").split(":")[:2]) for s in a.settings.split(",")]
    cfg = train_config(train_parser(Parser().add_subparsers(parser_class=Parser)).parse_args(flags))
    tmp = tempfile.mkdtemp(prefix="braidtrain-settings-")
    total = a.warmup + a.steps * len(settings)
    cfg = dataclasses.replace(cfg, out=tmp, max_steps=total, val_every=0, sample_tokens=0, progress=False, save=False)
    trainer = Trainer(cfg)
    off = trainer.opt.offload
    assert off is not None, "--offload optimizer"
    owned = sum(m.numel() for m in off.master)
    rows, step = [], 0
    try:
        with gc_by_hand():
            for _ in range(a.warmup):
                trainer.step(step)
                step += 1
            for threads, fold in settings:
                if threads:
                    os.environ["BRAIDTRAIN_HOST_THREADS"] = str(threads)
                else:
                    os.environ.pop("BRAIDTRAIN_HOST_THREADS", None)
                off.fold = bool(fold)
                recs = []
                for _ in range(a.steps + 1):  # (the first: its update ran under the setting before)
                    recs.append(trainer.step(step))
                    step += 1
                recs = recs[1:]
                n = len(recs)
                row = {"threads": threads, "fold": fold, "step_s": sum(r["step_s"] for r in recs) / n,
                       "update_s": sum(r["offload_update_s"] for r in recs) / n,
                       "exposed_s": sum(r["offload_s"] for r in recs) / n,
                       "tokens_per_s": sum(r["tokens_per_s"] for r in recs) / n}
                row["update_pps"] = owned / row["update_s"]
                rows.append(row)
                decay = "in kernel" if fold else "apart"
                print(f"settings {threads or 'own'} threads, decay {decay}: step {row['step_s']:.2f} s, "
                      f"{row['tokens_per_s']:,.0f} tokens/s, update {row['update_s']:.2f} s "
                      f"({row['update_pps'] / 1e9:.2f} G elements/s of {owned / 1e9:.2f} G), exposed "
                      f"{row['exposed_s']:.2f} s", flush=True)
    finally:
        trainer.guard.close(clean=True)
        trainer.rt.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
