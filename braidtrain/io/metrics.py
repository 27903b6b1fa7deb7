"""Per-step metrics (metrics.jsonl), the progress bar, model FLOPs utilisation, and loss plots."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from braidtrain.errors import UserError

# Dense peak FLOP/s by device name fragment: (bf16, fp32). MFU = achieved model FLOP/s over this.
# Model FLOPs per token are GPTConfig.flops_per_token: 6 per weight plus 12·L·T·C for attention.
PEAK_FLOPS = {
    "H200": (989e12, 67e12),
    "H100": (989e12, 67e12),
    "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12),
    "A10G": (125e12, 31.2e12),
    "4090": (165e12, 82.6e12),
}


def peak_flops(device: torch.device, bf16: bool) -> float | None:
    """The device's dense peak, or None where unknown (the CPU): MFU is then not reported."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (pb, pf) in PEAK_FLOPS.items():
        if key in name:
            return pb if bf16 else pf
    return None


def read_records(path: Path, warn=None) -> list[dict]:
    """metrics.jsonl's records. Its last line cut short (a full disk, a process killed as it wrote)
    is left out, and `warn` told in one line; a damaged line before it is an error."""
    lines = [(n, line) for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()]
    out = []
    for n, line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict):
            out.append(rec)
        elif n == lines[-1][0]:
            if warn:
                warn(f"note: {path}: its last line ({n}) is cut short, a write that did not finish: left out")
        else:
            raise UserError(f"{path} line {n} is not a JSON record (damaged): remove the line, or give another run")
    return out


def _stderr(msg: str) -> None:
    print(f"braidtrain: {msg}", file=sys.stderr, flush=True)


class MetricsLog:
    """metrics.jsonl: one JSON object per line; on resume, lines past the resumed step (and a last
    line cut short: read_records) are dropped so the file reads as one uninterrupted run."""

    def __init__(self, path: Path, resume_step: int = 0, warn=None):
        self.path = path
        if resume_step and path.exists():
            keep = [rec for rec in read_records(path, warn) if rec.get("step", 0) <= resume_step]
            path.write_text("".join(json.dumps(rec) + "\n" for rec in keep))
        elif path.exists():
            path.unlink()
        self.f = open(path, "a")

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()

    def close(self):
        self.f.close()


def read_metrics(run: Path) -> list[dict]:
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run}: no metrics.jsonl (is it a braidtrain run directory?)")
    return read_records(path, _stderr)


def plot_runs(runs: list[str], out: str) -> None:
    """Overlay the training (and validation) loss curves of several runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for run in runs:
        rows = read_metrics(Path(run))
        name = Path(run).name
        line = ax.plot([r["step"] for r in rows if "loss" in r], [r["loss"] for r in rows if "loss" in r],
                       label=f"{name} train", lw=1)
        val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
        if val:
            ax.plot(*zip(*val), "o--", color=line[0].get_color(), label=f"{name} val", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_schedule(run: str, out: str) -> None:
    """Each rank's work in the last step of a pipeline run (RUN/schedule.json, written by
    train): a bar per forward (F), backward (B; zb: its input half) and weight gradient (W),
    labelled by micro-batch, a row per rank; the title gives the schedule and each stage's bubble."""
    path = Path(run) / "schedule.json"
    if not path.is_file():
        raise UserError(f"{run}: no schedule.json (written at the end of a run with --pp 2 or more)")
    s = json.loads(path.read_text())
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
    ranks = s["ranks"]
    fig, ax = plt.subplots(figsize=(11, 0.5 + 0.45 * len(ranks)))
    for r, events in enumerate(ranks):
        for op, chunk, micro, t0, t1 in events:
            ax.barh(r, t1 - t0, left=t0, color=colors[op], edgecolor="white", alpha=0.6 + 0.4 * (chunk // s["pp"] == 0))
            ax.text((t0 + t1) / 2, r, str(micro), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r} (stage {st})" for r, st in enumerate(s["stage_of_rank"])])
    ax.invert_yaxis()
    ax.set_xlabel("seconds into the step")
    bubble = ", ".join(f"{100 * b:.0f}%" for b in s["bubble"]) if s.get("bubble") else "?"
    ax.set_title(f"{s['schedule']}, pp {s['pp']}" + (f" x {s['virtual']} chunks" if s["virtual"] > 1 else "")
                 + f": F forward, B backward, W weight gradients; bubble by stage {bubble}", fontsize=9)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_experts(run: str, out: str) -> None:
    """A mixture of experts' load over the steps of a run (metrics.jsonl's moe_load: each expert's
    share of the tokens kept, all MoE layers together), with the balanced share 1/E dashed and
    the share of assignments dropped at capacity beside it."""
    rows = [r for r in read_metrics(Path(run)) if "moe_load" in r]
    if not rows:
        raise UserError(f"{run}: no moe_load in metrics.jsonl (written by runs with --moe-experts)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, n = [r["step"] for r in rows], len(rows[0]["moe_load"])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    ax.stackplot(steps, list(zip(*[r["moe_load"] for r in rows])), labels=[f"expert {e}" for e in range(n)], alpha=0.85)
    for k in range(1, n):
        ax.axhline(k / n, color="black", lw=0.5, ls="--")
    ax.set(xlabel="step", ylabel="share of tokens (stacked; dashed: balanced)", ylim=(0, 1),
           title=f"{Path(run).name}: expert load (max/mean at the end {rows[-1]['moe_load_max']:.2f})")
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    bx.plot(steps, [100 * r["moe_dropped"] for r in rows], color="#c44e52")
    bx.set(xlabel="step", ylabel="% of assignments dropped at capacity")
    bx.grid(alpha=0.3)
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def fmt_rate(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


class Progress:
    """A tqdm bar on rank 0 (loss, tokens/s, MFU; tqdm shows the time left); silent elsewhere."""

    def __init__(self, enabled: bool, start: int, total: int):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, smoothing=0.1)

    def update(self, rec: dict) -> None:
        if self.bar is None:
            return
        post = {"loss": f"{rec['loss']:.4f}", "tok/s": fmt_rate(rec["tokens_per_s"])}
        if rec.get("mfu") is not None:
            post["mfu"] = f"{100 * rec['mfu']:.1f}%"
        if rec.get("val_loss") is not None:
            post["val"] = f"{rec['val_loss']:.4f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
