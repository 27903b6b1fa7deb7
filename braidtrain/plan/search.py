"""The ranking: every layout's estimate, ranked; for one that does not fit, the smallest change
that does; the recommendation; and `train --layout auto`'s choice."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import replace

import numpy as np
import torch

from braidtrain.errors import UserError
from braidtrain.layout import make_layout
from braidtrain.plan.estimate import estimate
from braidtrain.plan.memory import GB
from braidtrain.plan.space import MICRO_BATCHES, Candidate, Setup, layout_of, layouts, tp_degrees, valid


def lean_layout(s: Setup, gpus: int) -> Candidate | None:
    """The leanest layout on this many GPUs that fits: ZeRO-3 b=1 --recompute, with the smallest
    tp (and sp where it can) that fits; failing that, a 1f1b pipeline (ZeRO-2) of the fewest
    stages with the smallest tp; None if none does."""
    on = replace(s, gpus=gpus)
    tps = tp_degrees(s, gpus)
    tried = [Candidate(gpus // tp, 3, 1, True, tp, tp > 1 and valid(s, tp, True, gpus=gpus)) for tp in tps]
    tried += [Candidate(gpus // (tp * pp), 2, 1, True, tp, tp > 1 and valid(s, tp, True, gpus=gpus), pp, "1f1b")
              for pp in range(2, gpus + 1) for tp in tps if gpus % (tp * pp) == 0]
    for lay in tried:
        if layout_of(on, lay, s.d) is not None and estimate(on, lay)["fits"]:
            return lay
    return None


def gpus_needed(s: Setup, limit: int = 1 << 16) -> Candidate | None:
    """The fewest GPUs (doubling) on which a leanest layout fits, and that layout."""
    m = s.gpus * 2
    while m <= limit:
        lay = lean_layout(s, m)
        if lay is not None:
            return lay
        m *= 2
    return None


def rank(rows: list[dict]) -> list[dict]:
    """Fits first, then by step time. Times equal to 3 digits are a tie (the model cannot tell
    them apart); then fewer micro-steps (larger GEMMs, which a constant --tflops does not see),
    less sharding (tp first: its GEMMs are smaller too), less memory."""
    return sorted(rows, key=lambda e: (not e["fits"], float(f"{e['step_s']:.3g}"), e["micro_steps"],
                                       e["layout"].tp, e["layout"].pp, e["layout"].cp, e["layout"].zero,
                                       e["mem"]["total"]))


# what a fix may change (dp follows)
SETTINGS = ("tp", "sp", "pp", "schedule", "cp", "cp_impl", "ep", "zero", "b", "recompute")


@functools.cache
def settings(lay: Candidate) -> tuple:
    return tuple(getattr(lay, k) for k in SETTINGS)


MESH = ("dp", "tp", "sp", "pp", "schedule", "virtual", "cp", "cp_impl", "ep")  # a row of the table each, by default


def best_per_mesh(rows: list[dict]) -> list[dict]:
    """The first (best-ranked) row of each mesh, in rank order."""
    seen = set()
    return [e for e in rows if (key := tuple(getattr(e["layout"], k) for k in MESH)) not in seen and not seen.add(key)]


def settings_grid(rows: list[dict]):
    grid = np.empty((len(rows), len(SETTINGS)), dtype=object)
    for i, row in enumerate(rows):
        grid[i] = settings(row["layout"])
    return grid


def fix(s: Setup, e: dict, fitting: list[dict], grid=None) -> str:
    """The smallest change that makes a layout fit: the fitting layouts that differ from it in
    the fewest settings (the best of each kind of change); failing any, larger or more GPUs.
    grid: the fitting layouts' settings as an array (settings_grid), when many rows ask."""
    lay = e["layout"]
    grid = settings_grid(fitting) if grid is None else grid
    differs = grid != np.array(settings(lay), dtype=object)  # fitting x SETTINGS
    counts = differs.sum(axis=1)
    changed = lambda i: tuple(k for k, d in zip(SETTINGS, differs[i]) if d)
    say = {"tp": lambda c: f"tp={c.tp}", "sp": lambda c: "--sp" if c.sp else "no sp",
           "pp": lambda c: f"pp={c.pp}", "schedule": lambda c: c.schedule if c.pp > 1 else "",
           "cp": lambda c: f"cp={c.cp}", "cp_impl": lambda c: f"--cp-impl {c.cp_impl}" if c.cp > 1 else "",
           "ep": lambda c: f"ep={c.ep}",
           "zero": lambda c: f"ZeRO-{c.zero}", "b": lambda c: f"b={c.b}",
           "recompute": lambda c: "--recompute" if c.recompute else "no recompute"}
    opts = []
    if fitting:
        for i in np.flatnonzero(counts == counts.min()):  # best first: the first of each kind of change is its best
            ks = changed(i)
            if not any(ks == o[0] for o in opts):
                opts.append((ks, " ".join(filter(None, (say[k](fitting[i]["layout"]) for k in ks)))))
        opts = [o[1] for o in opts]
    else:
        opts.append(f"GPUs with >= {math.ceil(e['mem']['total'] / GB)} GB")
        m = gpus_needed(s)
        opts += [f"{m.gpus} GPUs with {m.name()}"] if m else []
    return f"{lay.name()} needs {e['mem']['total'] / GB:.1f} GB > {s.mem_gb:g} GB: use " + ", or ".join(opts)


def advice(s: Setup, lay: Candidate) -> str:
    """What the planner says of a layout that ran out of memory: its estimate and, if the
    estimate is over the memory too, the smallest change that fits (else: the estimate is short)."""
    e = estimate(s, lay)
    est = f"the planner estimates {e['mem']['total'] / GB:.1f} GB a rank for {lay.name()} (of {s.mem_gb:.1f} GB)"
    if e["fits"]:
        leaner = (f for f in rank([estimate(s, x) for x in layouts(s)]) if f["mem"]["total"] < 0.8 * e["mem"]["total"])
        fitting = sorted(leaner, key=lambda f: f["step_s"])
        return est + " -- an underestimate here" + (f"; leaner: {fitting[0]['layout'].name()}" if fitting else "")
    grid = rank([estimate(s, x) for x in layouts(s)])
    change = fix(s, e, [f for f in grid if f["fits"]])
    return est + "; " + change[change.index(": use ") + 2:]


def nothing_fits(s: Setup, grid: list[dict]) -> str:
    lean = min(grid, key=lambda e: e["mem"]["total"])
    need = lean["mem"]["total"] / GB
    msg = (f"nothing fits on {s.gpus} x {s.mem_gb:g} GB: the leanest layout, {lean['layout'].name()}, "
           f"needs {need:.1f} GB per GPU; use GPUs with >= {math.ceil(need)} GB")
    m = gpus_needed(s)
    if m:
        unit = s.t * m.dp
        msg += f", or {m.gpus} GPUs with {m.name()}" + (f" (-d a multiple of {unit})" if s.d % unit else "")
    return msg


def offload_wins(grid: list[dict], weigh) -> bool:
    """Whether --offload optimizer can win: nothing fits on the GPUs alone, or a layout that does
    not fit without it is faster than the best that does (no recompute, a larger micro-batch, less
    sharding) and, with it, fits and still is. Offloading only adds time to a layout, so only such
    a one can beat the best fitting layout. grid: every layout without offload, ranked; weigh: a
    layout's estimate."""
    best = next((e for e in grid if e["fits"]), None)
    if best is None:
        return True
    faster = (e["layout"] for e in grid if not e["fits"] and e["step_s"] < best["step_s"])
    return any((f := weigh(o))["fits"] and f["step_s"] < best["step_s"]
               for lay in faster for o in offloaded(lay, weigh))


def offloaded(lay: Candidate, weigh, ratio: float | None = None) -> list[Candidate]:
    """A layout under --offload optimizer: at `ratio` (plan --offload-ratio) if given; else at R = 1
    and at the smallest R = k/16 whose GPU memory fits -- the most of the update kept on the GPU,
    the fastest (weigh(...)["gpu_fits"]; the GPU's memory falls as R grows: bisected)."""
    if ratio is not None:
        return [replace(lay, offload=True, ratio=ratio)]
    whole = replace(lay, offload=True)
    if not weigh(whole)["gpu_fits"]:
        return [whole]
    lo, hi = 1, 16  # R = hi/16 fits
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if weigh(replace(whole, ratio=mid / 16))["gpu_fits"] else (mid + 1, hi)
    return [whole] + ([replace(whole, ratio=hi / 16)] if hi < 16 else [])


def plan(s: Setup, zeros=(0, 1, 2, 3), bs=MICRO_BATCHES, recomputes=(False, True), tps=None, sps=(False, True),
         pps=None, schedules=None, cps=None, eps=None, variants: bool = True, offloads=None,
         ratio: float | None = None) -> dict:
    """The layouts asked for, ranked, each that does not fit with its fix; the fixes and the
    recommendation look at every layout. variants=False: only each mesh's best layout. offloads:
    (False,), (True,) or both; None: each layout with --offload optimizer too where that can win
    (offload_wins); each offloaded at R = 1 and a partial R that fits, or at `ratio` (offloaded)."""
    seen = {}
    weigh = lambda lay: seen[lay] if lay in seen else seen.setdefault(lay, estimate(s, lay))
    grid = rank([weigh(lay) for lay in layouts(s)])
    if offloads is None:
        offloads = (False, True) if offload_wins(grid, weigh) else (False,)
    if True in offloads:
        grid = rank(grid + [weigh(o) for e in grid for o in offloaded(e["layout"], weigh, ratio)])
    asked = [o for lay in layouts(s, zeros, bs, recomputes, tps, sps, pps, schedules, cps, eps) for o in
             ([lay] if False in offloads else []) + (offloaded(lay, weigh, ratio) if True in offloads else [])]
    rows = rank([weigh(lay) for lay in asked])
    rows = rows if variants else best_per_mesh(rows)
    if not rows or not grid:
        unit = s.t * s.gpus
        raise UserError(f"-d {s.d} is not a multiple of b*t*dp = b*{s.t}*{s.gpus}/(tp*pp) for any allowed b, tp "
                        f"and pp: use -d {max(1, s.d // unit) * unit}")
    fitting = [e for e in grid if e["fits"]]
    grid_of_fits = settings_grid(fitting)
    for e in rows:
        e["fix"] = None if e["fits"] else fix(s, e, fitting, grid_of_fits)
    best = rows[0] if rows[0]["fits"] else fitting[0] if fitting else None
    if best is None:
        rec = nothing_fits(s, grid)
    else:
        rec = (f"recommended: {best['layout'].name()} on {s.gpus} GPU(s), {best['micro_steps']} micro-step(s): "
               f"{best['mem']['total'] / GB:.1f} of {s.mem_gb:g} GB, {best['step_s']:.3f} s/step, "
               f"{best['tokens_per_s']:,.0f} "
               "tokens/s" + ("" if best is rows[0] else " (none of the layouts asked for fits)"))
    return {"rows": rows, "recommendation": rec}


def why_offload(s: Setup, e: dict, rows: list[dict]) -> str:
    """auto_layout's word on an offloaded pick: its host memory, and nothing fits on the GPU alone,
    or the best layout without offload and how much slower it is."""
    host = f"; --offload optimizer: {e['host'] / GB:.1f} of {s.host_gb:.1f} GB of host memory, "
    plain = next((f for f in rows if f["fits"] and not f["layout"].offload), None)
    if plain is None:
        return host + f"since nothing fits on the GPU{'s' if s.gpus > 1 else ''} alone"
    return host + (f"faster than the best layout without it ({plain['layout'].name()}, "
                   f"{plain['tokens_per_s']:,.0f} tokens/s)")


def auto_layout(cfg, model, world: int, device: str, gpus_per_node: int | None = None,
                mem_gb: float | None = None, host_gb: float | None = None) -> tuple[dict, str]:
    """--layout auto: the best-ranked layout that fits these processes' memory (each GPU's, or on
    the CPU the machine's over the processes) and that `train` accepts with the run's other
    settings (--exact, --compile, --cuda-graph); the Config values it sets (config.AUTO_CHOSEN)
    and a line saying what it chose. Every rank computes the same plan: nothing to agree on.
    mem_gb: a process's memory (default: the GPU's, or the CPU's share); host_gb: the node's host
    memory, where --offload optimizer keeps the optimizer's state (default: the machine's). Where it
    picks --offload, the line says why: nothing fits on the GPU alone, or it is faster than the best
    layout without it."""
    if not cfg.total_batch:
        raise UserError("--layout auto keeps the tokens per step fixed and chooses the rest: give -d (--total-batch)")
    cpu = device != "cuda"
    if mem_gb is None:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world if cpu else torch.cuda.mem_get_info()[1]
        mem_gb = mem / GB
    if host_gb is None:
        host_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    s = Setup(model, world, mem_gb, cfg.seq_len, cfg.total_batch, bucket_mb=cfg.bucket_mb, cpu=cpu, fp8=cfg.fp8,
              gpus_per_node=gpus_per_node, compile=cfg.compile, live=cfg.live_recovery, host_gb=host_gb)
    rows = plan(s)["rows"]
    for e in (e for e in rows if e["fits"]):
        lay = e["layout"]
        try:
            make_layout(world, model, seq_len=s.t, batch_size=lay.b, total_batch=s.d, exact=cfg.exact,
                        compile=cfg.compile, cuda_graph=cfg.cuda_graph, cp_order=cfg.cp_order, device=device,
                        **lay.layout_kw())
            if lay.offload and cfg.live_recovery:
                continue
        except UserError:
            continue
        chosen = dict(pp=lay.pp, pp_schedule=lay.schedule if lay.pp > 1 else "1f1b", pp_split=None,
                      pp_virtual=lay.virtual if lay.pp > 1 and lay.virtual > 1 else None, cp=lay.cp,
                      cp_impl=lay.cp_impl, tp=lay.tp, sp=lay.sp, ep=lay.ep, zero=lay.zero, batch_size=lay.b,
                      recompute=lay.recompute, offload="optimizer" if lay.offload else None,
                      offload_ratio=lay.ratio if lay.offload and lay.ratio < 1 else None)
        speed = "" if cpu else f", {e['tokens_per_s']:,.0f} tokens/s at {s.tflops:g} TFLOP/s"
        return chosen, (f"--layout auto: {lay.name()}, dp {lay.dp} (planned {e['mem']['total'] / GB:.1f} of "
                        f"{s.mem_gb:.1f} GB{speed})" + (why_offload(s, e, rows) if lay.offload else ""))
    if not any(e["fits"] for e in rows):
        raise UserError("--layout auto: " + nothing_fits(s, rows))
    asked = (("--exact", cfg.exact), ("--compile", cfg.compile), ("--cuda-graph", cfg.cuda_graph))
    flags = " ".join(f for f, on in asked if on)
    raise UserError(f"--layout auto: no layout that fits runs with {flags}: drop {flags}, or choose the layout by hand")
