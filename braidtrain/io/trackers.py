"""TensorBoard and Weights & Biases, fed the same per-step records as metrics.jsonl (rank 0 only).

    train --tensorboard       event files in RUN/tb/          tensorboard --logdir runs/
    train --wandb PROJECT     a W&B run in RUN/wandb/         WANDB_MODE=offline: no network; wandb sync

A record's every numeric field is a scalar at the record's step, under its metrics.jsonl name:
loss, lr, grad_norm, tokens_per_s, ..., val_loss and eval_acc at the steps that evaluated. A list
is one scalar per element (bubble/0, bubble/1: pipeline stages; moe_load/0, ...: experts), true and
false (skipped) are 1 and 0; text (skip_reason) and missing values (mfu on a CPU, a non-finite
loss) are left out. TensorBoard keeps float32 scalars: each is metrics.jsonl's value rounded to
float32 (W&B's are the values themselves).

A restarted run (--resume, or torchrun's restart) continues the same curves, and, as metrics.jsonl
does, keeps only the steps up to its checkpoint from the attempt before:

- TensorBoard: the new event file opens with TensorBoard's restart marker at the first step it
  will write (torch's SummaryWriter(purge_step=)): TensorBoard drops what earlier files hold from
  that step on. Each record is flushed as it is written, so a killed attempt's steps are on disk.
  A run that had no event files yet (--tensorboard turned on at the resume) first gets the kept
  steps from metrics.jsonl.
- W&B: the run's id is kept in RUN/wandb/braidtrain-run-id and the run resumed under it. W&B
  writes its data some seconds late (its .wandb file every 15 s offline), so a killed attempt's
  last steps may never have reached it: the resumed run is sent the kept steps it does not hold,
  from metrics.jsonl. Online, those are the steps from the resumed run's current step on (W&B
  keeps what it holds below it, and would ignore them). Offline, nothing is known of the earlier
  attempt's folder: the new offline folder gets every kept step, and the earlier folders of the
  run (superseded) are removed, so RUN/wandb holds one offline run to `wandb sync`.

Neither package is needed unless asked for: they are imported here, when a run opens them.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import secrets
import shutil
from pathlib import Path

from braidtrain.errors import UserError
from braidtrain.io.metrics import read_records

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # flag -> the package it needs


def check_installed(tensorboard: bool, wandb: str | None) -> None:
    """One line naming the package, before anything starts (config.validate calls it)."""
    for flag, wanted in (("tensorboard", tensorboard), ("wandb", wandb)):
        if wanted and importlib.util.find_spec(PACKAGES[flag]) is None:
            raise UserError(f"--{flag} needs the {PACKAGES[flag]} package: run `pip install {PACKAGES[flag]}`")


def scalars(rec: dict) -> dict[str, float]:
    """A metrics.jsonl record's numeric fields as {name: value}, but its step."""
    out = {}
    for key, value in rec.items():
        if key == "step":
            continue
        values = {f"{key}/{i}": v for i, v in enumerate(value)} if isinstance(value, (list, tuple)) else {key: value}
        for name, v in values.items():
            if isinstance(v, (bool, int, float)) and math.isfinite(v):
                out[name] = float(v)
    return out


def _kept(out: Path, start_step: int) -> list[dict]:
    """metrics.jsonl's records up to the resumed step (what MetricsLog keeps)."""
    path = out / "metrics.jsonl"
    if not start_step or not path.is_file():
        return []
    return [r for r in read_records(path) if r.get("step", 0) <= start_step]  # (MetricsLog said what it left out)


class TensorBoard:
    def __init__(self, out: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        logdir = out / "tb"
        replay = not any(logdir.glob("events.out.tfevents.*"))
        self.writer = SummaryWriter(str(logdir), purge_step=start_step + 1)
        if replay:
            for rec in _kept(out, start_step):
                self.write(rec, flush=False)
            self.writer.flush()

    def write(self, rec: dict, flush: bool = True) -> None:
        for name, value in scalars(rec).items():
            # TensorBoard's plain float32 scalar: its default loader (tensorboard-data-server 0.7)
            # shows no float64 ones
            self.writer.add_scalar(name, value, rec["step"])
        if flush:
            self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandB:
    def __init__(self, out: Path, project: str, start_step: int, resume: bool, config: dict):
        import wandb

        id_file = out / "wandb" / "braidtrain-run-id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        if not run_id:
            run_id = secrets.token_hex(4)  # (W&B's own ids: 8 lowercase letters and digits)
            id_file.write_text(run_id + "\n")  # before init: a kill during it still resumes this run
        try:
            self.run = wandb.init(project=project, id=run_id, resume="allow", dir=str(out), name=out.name,
                                  config=config, allow_val_change=True)
        except Exception as e:  # (no login, no network, a bad project name: W&B's own words)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"--wandb {project}: W&B could not start the run ({first}); run `wandb login`, or set "
                            f"WANDB_MODE=offline to write it to {out / 'wandb'} and `wandb sync` it later") from None
        if self.run.offline:  # every kept step goes into this folder: the earlier ones are superseded
            mine = Path(self.run.sync_dir).resolve()
            for old in (out / "wandb").glob(f"offline-run-*-{run_id}"):
                if old.resolve() != mine:
                    shutil.rmtree(old, ignore_errors=True)
        for rec in _kept(out, start_step):
            if rec["step"] >= self.run.step:  # online: what W&B does not hold yet
                self.write(rec)

    def write(self, rec: dict) -> None:
        self.run.log(scalars(rec), step=rec["step"])

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Trackers:
    """The run's trackers (rank 0): write(record) after each metrics.jsonl line; close() at the end."""

    def __init__(self, cfg, out: Path, start_step: int):
        self.sinks = []
        try:
            if cfg.tensorboard:
                self.sinks.append(TensorBoard(out, start_step))
            if cfg.wandb:
                self.sinks.append(WandB(out, cfg.wandb, start_step, bool(cfg.resume), dataclasses.asdict(cfg)))
        except BaseException:
            self.close(failed=True)
            raise

    def write(self, rec: dict) -> None:
        for sink in self.sinks:
            sink.write(rec)

    def close(self, failed: bool = False) -> None:
        for sink in self.sinks:
            sink.close(failed)
        self.sinks = []
