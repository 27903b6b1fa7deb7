"""Run as 8 ranks (gloo; forked by the tests' process server, with the environment torchrun gives its
workers: helpers.Layouts) once a test session (conftest.py's `layout_suites`) for
test_parity.py, test_tp.py, test_pipeline.py, test_context.py, test_moe.py and test_composition.py
(argv: OUT, then the suites, comma-separated, of "dp", "tp", "pipeline", "cp", "ep", "matrix"):
many layouts of one small GPT (a mixture of experts for "ep") in one process group -- each on the first
pp*dp*tp ranks, the others waiting -- trained a few steps with
the engine, the schedule's executor and AdamW as the trainer drives them (train.Trainer.work),
on the same global batches. Writes, per layout, every step's loss and gradient norm, the final
weights_sha256, each rank's most micro-batches alive at once, and whether the pipeline's two
copies of the tied wte are bitwise equal, to OUT/results_<suite>.json."""

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from braidtrain.build import make_parts
from braidtrain.io import checkpoint
from braidtrain.io.checkpoint import weights_sha256
from braidtrain.collective.comm import Comm
from braidtrain.layout import make_layout
from braidtrain.collective.mesh import build_mesh
from braidtrain.parallel.placement import init_weights
from braidtrain.model.registry import model_config
from braidtrain.optim import AdamW, clip_scale, lr_at
from braidtrain.parallel.context import Context, token_index
from braidtrain.model import fp8
from braidtrain.model.moe import Dispatch as LocalDispatch, MoE, route
from braidtrain.parallel.engine import Engine
from braidtrain.parallel import expert
from braidtrain.parallel.expert import Dispatch
from braidtrain.passes import Passes, reduce_loss

CFG = model_config("tiny", 256, n_layer=8, n_embd=32, n_head=4, block_size=16)  # 4 heads: tp up to 4
MOE = model_config("tiny", 256, n_layer=4, n_embd=32, n_head=4, block_size=16, moe_experts=4, moe_top_k=2,
                   moe_hidden=48, moe_every=1, moe_capacity=1.0, moe_aux=0.01)
# Llama-3's shape: RMSNorm, RoPE (scaled), grouped-query attention (4 heads over 2 key/value heads: tp up to 2),
# SwiGLU, an untied head; LLAMA_TIED ties it, as Llama-3.2 1B and 3B do
LLAMA = model_config("llama3-tiny", 256, n_layer=4, n_embd=32, n_head=4, n_kv_heads=2, block_size=16)
LLAMA_TIED = replace(LLAMA, tie_embeddings=True)
# Mixtral's shape (SwiGLU experts, GQA, RoPE), capacity 1.0 and the balance loss; MIXTRAL_BIAS balances by
# DeepSeek-V3's per-expert bias instead, with a shared expert beside the routed ones
MIXTRAL = model_config("mixtral-tiny", 256, n_layer=4, n_embd=32, n_head=4, n_kv_heads=2, block_size=16, moe_hidden=24,
                       moe_capacity=1.0)
MIXTRAL_BIAS = replace(MIXTRAL, moe_balance="bias", moe_bias_rate=0.01, moe_shared=1)
T, B, SEQS = 16, 1, 8  # 8 sequences a step: 8 micro-steps at dp 1, 4 at dp 2
STEPS = 4  # a default-mode layout's steps: the loss of its last below its first's (each step its own batch), every
# step's loss and gradient norm compared
EXACT = 3  # an exact layout's steps where nothing resumes midway: warmup, the top and the decay of the schedule, every
# loss, gradient norm and the final weights bitwise (the offload, lean and matrix suites: 4, resumed at 2)


def layouts(suite: str):
    """(name, layout keywords, steps)."""
    if suite == "dp":  # data parallelism alone: every ZeRO stage on 2 ranks, the sharded ones on 4 and 8
        default = [(2, 0), (2, 1), (2, 2), (2, 3), (4, 1), (4, 2), (4, 3), (8, 1)]
        exact = [(1, 3), (2, 0), (2, 1), (2, 2), (2, 3), (4, 0), (4, 1), (4, 2), (4, 3), (8, 0), (8, 1)]
        # (7 steps in default mode: test_parity asks each for a loss down by 0.05, what 4 steps do not learn)
        return ([("ref", dict(), 7), ("ref-exact", dict(exact=True), EXACT)]
                + [(f"dp{dp}-z{z}", dict(dp=dp, zero=z), 7) for dp, z in default]
                + [("dp2-z3-recompute", dict(dp=2, zero=3, recompute=True), 7)]
                + [(f"dp{dp}-z{z}-exact", dict(dp=dp, zero=z, exact=True), EXACT) for dp, z in exact])
    if suite == "cp":  # context parallelism: cp 2 and 4, ring and allgather, with dp / ZeRO, tp (sp), pp
        # (cp with tp, pp and both, with and without exact mode: the "matrix" suite)
        # b = 2 in default mode: half the micro-steps, a batch dim the ring must keep apart
        default = [("cp2", dict(cp=2, b=2)), ("cp4", dict(cp=4, b=2)), ("cp2-contiguous", dict(cp=2, cp_order="contiguous")),
                   ("cp2-dp2-z1", dict(cp=2, dp=2, zero=1, b=2)), ("cp2-tp2-sp", dict(cp=2, tp=2, sp=True, b=2))]
        exact = [("cp2-exact", dict(cp=2)), ("cp2-dp2-z0-exact", dict(cp=2, dp=2)), ("cp2-dp2-z3-exact", dict(cp=2, dp=2, zero=3)),
                 ("cp2-dp4-z1-exact", dict(cp=2, dp=4, zero=1)),
                 ("cp2-allgather-exact", dict(cp=2, cp_impl="allgather")),
                 ("cp2-dp2-z3-allgather-exact", dict(cp=2, dp=2, zero=3, cp_impl="allgather"))]
        return ([("ref", dict(), 4)] + [(n, kw, 4) for n, kw in default]  # 4 steps: the ring's transfers are many
                + [(n, dict(kw, exact=True), EXACT) for n, kw in exact])
    if suite == "ep":  # experts over ep ranks of the dp (x cp) replicas, with ZeRO, tp, pp, cp
        # (dp 4 x ep 4 and pp 2 x dp 2 x ep 2, resumed across layouts: the "matrix" suite)
        default = [("dp2-ep1", dict(dp=2)), ("dp2-ep2", dict(dp=2, ep=2)), ("dp4-ep2-z1", dict(dp=4, ep=2, zero=1)),
                   ("dp8-ep4-z2", dict(dp=8, ep=4, zero=2)), ("tp2-dp2-ep2", dict(tp=2, dp=2, ep=2)),
                   # cp and sp give a rank a share of each sequence: the routing groups change with it (moe.py),
                   # so they are compared dropless without the balance loss (what depends on the groups), and
                   # then at b = 2 (a routing group of two sequences)
                   ("cp2-ep2-free", dict(cp=2, ep=2, cfg="free", b=2)),
                   ("tp2-sp-dp2-ep2-free", dict(tp=2, sp=True, dp=2, ep=2, cfg="free", b=2))]
        exact = [("dp4-ep1-z0", dict(dp=4)), ("dp4-ep2-z0", dict(dp=4, ep=2)), ("dp4-ep4-z0", dict(dp=4, ep=4)),
                 ("dp4-ep2-z3", dict(dp=4, ep=2, zero=3)),
                 ("dp8-ep4-z1", dict(dp=8, ep=4, zero=1)), ("dp2-ep2-z2-recompute", dict(dp=2, ep=2, zero=2, recompute=True))]
        # Mixtral's shape (test_moe.py): ep 2 with pp 2 and with tp 2, bias balancing; exact across ep 1/2/4 at
        # dp 4, ZeRO 0 and 3
        mix = [("mix-ref", dict(cfg="mix"), STEPS), ("mix-dp2-ep2-pp2", dict(cfg="mix", dp=2, ep=2, pp=2, zero=1), STEPS),
               ("mix-tp2-dp2-ep2", dict(cfg="mix", tp=2, dp=2, ep=2), STEPS), ("mix-bias-ref", dict(cfg="mix-bias"), STEPS),
               ("mix-bias-dp2-ep2-tp2", dict(cfg="mix-bias", tp=2, dp=2, ep=2, zero=1), STEPS),
               ("mix-ref-exact", dict(cfg="mix", exact=True), EXACT)]
        mix += [(f"mix-dp4-ep{ep}-z{z}-exact", dict(cfg="mix", dp=4, ep=ep, zero=z, exact=True), EXACT)
                for ep, z in ((1, 0), (2, 0), (4, 0), (2, 3), (4, 3))]
        return ([("ref", dict(), STEPS), ("ref-free", dict(cfg="free"), STEPS),
                 ("ref-exact", dict(exact=True), EXACT)]
                + [(n, kw, STEPS) for n, kw in default] + [(n + "-exact", dict(kw, exact=True), EXACT) for n, kw in exact]
                + mix)
    if suite == "llama":  # the Llama-3 family on every axis (test_llama.py), default mode and exact
        default = [("dp2-z1", dict(dp=2, zero=1)), ("dp2-z3", dict(dp=2, zero=3)), ("tp2-sp", dict(tp=2, sp=True)),
                   ("pp2-1f1b", dict(pp=2, schedule="1f1b")), ("pp2-zb", dict(pp=2, schedule="zb")), ("cp2", dict(cp=2)),
                   ("pp2-tp2-dp2", dict(pp=2, tp=2, dp=2, zero=1)), ("pp2-cp2-dp2", dict(pp=2, cp=2, dp=2, zero=1)),
                   ("tied-pp2-dp2", dict(pp=2, dp=2, zero=1, cfg="tied"))]
        exact = [("dp2-z0", dict(dp=2)), ("dp2-z1", dict(dp=2, zero=1)), ("dp4-z2", dict(dp=4, zero=2)),
                 ("dp4-z3", dict(dp=4, zero=3)), ("pp2-1f1b-dp2", dict(pp=2, dp=2, zero=1, schedule="1f1b")),
                 ("pp2-zb", dict(pp=2, zero=2, schedule="zb")), ("tied-pp2-interleaved", dict(pp=2, schedule="interleaved",
                                                                                            cfg="tied"))]
        return ([("ref", dict(), STEPS), ("ref-tied", dict(cfg="tied"), STEPS), ("ref-exact", dict(exact=True), EXACT),
                 ("ref-tied-exact", dict(exact=True, cfg="tied"), EXACT)]
                + [(n, kw, STEPS) for n, kw in default] + [(n + "-exact", dict(kw, exact=True), EXACT) for n, kw in exact])
    if suite == "offload":  # --offload optimizer against none (test_offload.py): dp 1, 2, 4 at ZeRO 0-3
        # (exact mode's runs, and default mode's at dp 2, hold the host update back until the forward asks
        # for each bucket: offload.py's test hook, so that a forward or a reader that does not wait reads
        # stale weights every time)
        off, held = dict(offload="optimizer"), dict(offload="optimizer", hold=True)
        default = [(1, 0), (2, 0), (2, 1), (2, 2), (2, 3), (4, 1), (4, 3)]
        exact = [(1, 0), (2, 0), (2, 1), (2, 2), (2, 3), (4, 0), (4, 1), (4, 2), (4, 3)]
        return ([(f"dp{dp}-z{z}", dict(dp=dp, zero=z, cfg="shallow"), 4) for dp, z in default]
                # (held at dp 2, free-running -- the worker as fast as it goes -- at dp 1 and 4)
                + [(f"dp{dp}-z{z}-offload", dict(dp=dp, zero=z, cfg="shallow", **(held if dp == 2 else off)), 4)
                   for dp, z in default]
                + [("ref-exact", dict(exact=True, cfg="shallow"), 4)]
                + [(f"dp{dp}-z{z}-offload-exact", dict(dp=dp, zero=z, exact=True, cfg="shallow", **held), 4)
                   for dp, z in exact]
                # with the other axes: tp (bitwise at its own tp), pp, experts over ep ranks
                + [("tp2-dp2-z1-exact", dict(tp=2, dp=2, zero=1, exact=True, cfg="shallow"), 4),
                   ("tp2-dp2-z1-offload-exact", dict(tp=2, dp=2, zero=1, exact=True, cfg="shallow", **held), 4),
                   ("pp2-dp2-z1-offload-exact", dict(pp=2, dp=2, zero=1, exact=True, cfg="shallow", **held), 4),
                   ("pp2-z0-offload-exact", dict(pp=2, exact=True, cfg="shallow", **held), 4),
                   ("moe-ref-exact", dict(exact=True), 4),
                   ("moe-dp4-ep2-z3-offload-exact", dict(dp=4, ep=2, zero=3, exact=True, **held), 4),
                   # --recompute (each block's forward again in the backward), --fp8 (--compile: test_offload.py)
                   ("recompute-dp2-z3-offload-exact", dict(dp=2, zero=3, recompute=True, exact=True, cfg="shallow", **held), 4),
                   ("fp8-exact", dict(fp8="tensorwise", exact=True, cfg="shallow"), 4),
                   ("fp8-dp2-z2-offload-exact", dict(dp=2, zero=2, fp8="tensorwise", exact=True, cfg="shallow", **held), 4)]
                # --offload-ratio: the leading buckets kept on the device, the rest hosted (held)
                + [(f"dp2-z{z}-ratio{r:g}", dict(dp=2, zero=z, cfg="shallow", offload_ratio=r, **held), 4)
                   for z in (1, 3) for r in (0.5, 1e-6, 1e-17)]  # (1e-17: 1 - R rounds to 1)
                + [(f"dp{dp}-z{z}-ratio0.5-exact", dict(dp=dp, zero=z, exact=True, cfg="shallow", offload_ratio=0.5,
                                                        **held), 4) for dp, z in ((1, 0), (2, 0), (2, 1), (2, 2), (2, 3))]
                # ... with the other axes, as R = 1's above (a pipeline's stages: each keeps its own leading buckets)
                + [(f"{n}-ratio0.5-exact", dict(kw, exact=True, offload_ratio=0.5, **held), 4)
                   for n, kw in (("tp2-dp2-z1", dict(tp=2, dp=2, zero=1, cfg="shallow")),
                                 ("pp2-dp2-z1", dict(pp=2, dp=2, zero=1, cfg="shallow")),
                                 ("pp2-z0", dict(pp=2, cfg="shallow")), ("moe-dp4-ep2-z3", dict(dp=4, ep=2, zero=3)))]
                + [("pp2-z0-ratio0.5", dict(pp=2, cfg="shallow", offload_ratio=0.5, **held), 4)])
    if suite == "lean":  # a lean state (bf16 compute buckets, fp32 masters apart) against the old path (test_lean.py):
        # at ZeRO 1-3 on 2 and 4 ranks, and with --offload optimizer (then at ZeRO-0 and on one rank too)
        old, lean = dict(bf16=True, lean=False, cfg="shallow"), dict(bf16=True, cfg="shallow")
        default = [(1, 0), (2, 1), (2, 3), (4, 2)]
        exact = [(1, 0), (2, 0), (2, 1), (2, 2), (2, 3), (4, 0), (4, 1), (4, 2), (4, 3)]
        off = dict(offload="optimizer")
        return ([(f"dp{dp}-z{z}-old", dict(old, dp=dp, zero=z), 4) for dp, z in default]
                + [(f"dp{dp}-z{z}", dict(lean, dp=dp, zero=z), 4) for dp, z in default]
                + [("ref-exact-old", dict(old, exact=True), 4)]
                + [(f"dp{dp}-z{z}-exact", dict(lean, dp=dp, zero=z, exact=True), 4) for dp, z in exact]
                # the other axes, bitwise against the old path at their own tp; Llama (RMSNorm, an untied
                # head); the experts' stacks; --offload optimizer's host master
                + [("pp2-dp2-z1-exact", dict(lean, pp=2, dp=2, zero=1, exact=True, schedule="1f1b"), 4),
                   ("tp2-dp2-z1-exact-old", dict(old, tp=2, dp=2, zero=1, exact=True), 4),
                   ("tp2-dp2-z1-exact", dict(lean, tp=2, dp=2, zero=1, exact=True), 4),
                   ("llama-ref-exact-old", dict(old, exact=True, cfg="llama"), 4),
                   ("llama-dp2-z3-exact", dict(lean, dp=2, zero=3, exact=True, cfg="llama"), 4),
                   ("llama-pp2-dp2-z2-exact", dict(lean, pp=2, dp=2, zero=2, exact=True, cfg="llama"), 4),
                   ("moe-ref-exact-old", dict(old, exact=True, cfg=None), 4),
                   ("moe-dp4-ep2-z3-exact", dict(lean, dp=4, ep=2, zero=3, exact=True, cfg=None), 4),
                   ("dp2-z1-offload", dict(lean, dp=2, zero=1, **off), 4)]
                # offload: the master on the host -- a lean state at ZeRO-0 and on one rank too
                + [(f"dp{dp}-z{z}-offload-exact", dict(lean, dp=dp, zero=z, exact=True, **off), 4)
                   for dp, z in ((1, 0), (2, 0), (2, 1), (4, 3))]
                # --offload-ratio 0.5: the kept buckets' bf16 weights published from their device masters
                + [("dp2-z1-ratio0.5-offload", dict(lean, dp=2, zero=1, offload_ratio=0.5, **off), 4)]
                + [(f"dp{dp}-z{z}-ratio0.5-exact", dict(lean, dp=dp, zero=z, exact=True, offload_ratio=0.5, **off), 4)
                   for dp, z in ((1, 0), (2, 1))])
    if suite == "tp":  # without a pipeline: tp 2 and 4, with sp, dp and ZeRO
        return [("ref", dict(), 4)] + [  # 4 steps at b = 2: gloo's tp collectives are many, and each costs
            (f"tp{tp}-dp{dp}" + ("-sp" if sp else "") + f"-z{z}", dict(tp=tp, dp=dp, sp=sp, zero=z, b=2), 4)
            for tp, dp, sp, z in ((2, 1, False, 0), (2, 1, True, 1), (4, 1, False, 0), (4, 1, True, 0),
                                  (2, 2, False, 1), (2, 2, True, 0), (2, 4, True, 1), (4, 2, True, 2))]
    out = [("ref", dict(), STEPS), ("ref-exact", dict(exact=True), EXACT)]
    for pp in (2, 4):
        for sched in ("gpipe", "1f1b", "interleaved", "zb"):
            out.append((f"pp{pp}-{sched}", dict(pp=pp, schedule=sched), STEPS))
            for dp in (1, 2):
                if pp * dp <= 8:
                    out.append((f"pp{pp}-dp{dp}-{sched}-exact", dict(pp=pp, dp=dp, schedule=sched, exact=True, zero=1),
                                    EXACT))
    out += [("pp2-dp2-z1", dict(pp=2, dp=2, zero=1), STEPS), ("pp2-dp2-z2-zb", dict(pp=2, dp=2, zero=2, schedule="zb"), STEPS),
            # b = 2: under sp a rank's rows of a micro-batch are a slice, sent contiguous
            ("pp2-tp2-sp", dict(pp=2, tp=2, sp=True, b=2), STEPS),  # (pp 2 x dp 2 x tp 2: the "matrix" suite)
            ("pp2-recompute", dict(pp=2, recompute=True), STEPS),
            ("pp2-dp2-z0-exact", dict(pp=2, dp=2, zero=0, exact=True), EXACT),
            ("pp2-dp2-z2-exact", dict(pp=2, dp=2, zero=2, exact=True, schedule="interleaved"), EXACT)]
    return out


# The composition matrix (test_composition.py): groups of layouts of one model, each group's first
# (the base) trained straight through and saving a checkpoint midway, every other one trained to
# midway fresh, saving too, then resumed from the previous member's midway checkpoint to the end:
# (name, model, base, cells), each layout's keywords; steps and midway per mode.
MATRIX = [
    ("dense", "dense", ("ref", dict()), [
        ("pp2-dp2-tp2", dict(pp=2, dp=2, tp=2, zero=1, schedule="1f1b")),
        ("pp2-cp2-dp2", dict(pp=2, cp=2, dp=2, zero=1, schedule="interleaved")),
        ("dp2-cp2-tp2", dict(dp=2, cp=2, tp=2, zero=3, b=2)),  # (b = 2: half the micro-steps of tp x cp)
        ("pp2-dp4-z2", dict(pp=2, dp=4, zero=2, schedule="zb")),  # ZeRO-3 is refused with a pipeline
        ("tp2-cp2-pp2", dict(tp=2, cp=2, pp=2, schedule="gpipe", b=2))]),
    ("moe", "moe", ("ref", dict()), [
        ("dp4-ep4-z3", dict(dp=4, ep=4, zero=3)),
        ("pp2-dp2-ep2", dict(pp=2, dp=2, ep=2, zero=1, schedule="1f1b"))]),
    # exact mode: bitwise across the dp / pp / ZeRO / ep variants of one tp and cp
    ("tp1-cp1-exact", "dense", ("ref", dict()), [("pp2-dp4-z2", dict(pp=2, dp=4, zero=2, schedule="zb"))]),
    ("tp2-exact", "dense", ("tp2", dict(tp=2)), [("pp2-dp2-tp2", dict(pp=2, dp=2, tp=2, zero=1, schedule="1f1b"))]),
    ("cp2-exact", "dense", ("cp2", dict(cp=2)), [("pp2-cp2-dp2", dict(pp=2, cp=2, dp=2, zero=1, schedule="interleaved"))]),
    ("tp2-cp2-exact", "dense", ("dp2-cp2-tp2", dict(dp=2, cp=2, tp=2, zero=3)), [  # tp x cp costs most: its base a cell
        ("tp2-cp2-pp2", dict(tp=2, cp=2, pp=2, schedule="gpipe"))]),
    ("moe-exact", "moe", ("ref", dict()), [
        ("dp4-ep4-z3", dict(dp=4, ep=4, zero=3)), ("pp2-dp2-ep2", dict(pp=2, dp=2, ep=2, zero=1, schedule="1f1b"))]),
]
MATRIX_STEPS = {False: (STEPS, STEPS // 2), True: (4, 2)}  # (steps, midway) in default and exact mode
# 4 blocks: pp 2 x interleaved 2 still a block a chunk; tp's and cp's messages are per block
SHALLOW = replace(CFG, n_layer=4)


def matrix(rank, out):
    """Every group of MATRIX: {group: {layout: result}}; each result's losses and norms are the
    whole run's (a resumed cell's: its fresh steps to midway, then its resumed ones)."""
    from pathlib import Path

    results = {}
    halves = []  # (group, name, kw, cfg, its checkpoint, the checkpoint it resumes from)
    for group, model, base, cells in MATRIX:
        exact = group.endswith("exact")
        steps, mid = MATRIX_STEPS[exact]
        cfg = MOE if model == "moe" else SHALLOW
        ckpt = lambda name: Path(out) / "ckpt" / group / name
        members = [base] + cells
        results[group] = {}
        for i, (name, kw) in enumerate(members):
            r = run(rank, name, dict(kw, exact=exact), steps, cfg, save=(mid, ckpt(name)), until=None if i == 0 else mid)
            if rank == 0:
                results[group][name] = r
            dist.barrier()
            if i:
                halves.append((group, name, dict(kw, exact=exact), cfg, steps, ckpt(members[i - 1][0])))
    for group, name, kw, cfg, steps, source in halves:
        r = run(rank, name, kw, steps, cfg, resume=source)
        if rank == 0:
            fresh = results[group][name]
            results[group][name] = {**r, "losses": fresh["losses"] + r["losses"], "norms": fresh["norms"] + r["norms"],
                                    "resumed_from": source.name}
        dist.barrier()
    return results


def _switched(rank, out, kind, cases):
    """Each case (name, first, second): an exact run of `first` saved at step 2, resumed as `second`
    to the end; rank 0 keeps each resumed run's result, by name."""
    from pathlib import Path

    results = {}
    for name, first, second in cases:
        ckpt = Path(out) / "ckpt" / kind / name
        run(rank, name + "-first", dict(first, exact=True), 4, SHALLOW, save=(2, ckpt), until=2)
        dist.barrier()
        r = run(rank, name, dict(second, exact=True), 4, SHALLOW, resume=ckpt)
        if rank == 0:
            results[name] = r
        dist.barrier()
    return results


def lean_resumes(rank, out):
    """Exact bf16 runs that stop midway and resume with the lean state switched (test_lean.py):
    each, at its end, against the straight run of the old path ("ref-exact-old")."""
    old, lean, off = dict(bf16=True, lean=False), dict(bf16=True), dict(offload="optimizer")
    return _switched(rank, out, "lean", (
        ("into-lean", dict(old, dp=2, zero=1), dict(lean, dp=2, zero=3)),
        ("out-of-lean", dict(lean, dp=2, zero=2), dict(old)),
        ("lean-into-offload", dict(lean, dp=4, zero=1), dict(lean, dp=2, zero=0, **off)),
        ("offload-out-of-lean", dict(lean, dp=2, zero=3, **off), dict(old, dp=4, zero=2))))


def offload_resumes(rank, out):
    """Exact runs that stop midway and resume with offload switched (test_offload.py): each, at
    its end, against the straight run without offload ("ref-exact")."""
    off = dict(offload="optimizer", hold=True)  # (a save that does not wait for the update saves stale state)
    return _switched(rank, out, "offload", (("into-offload", dict(dp=2, zero=1), dict(dp=2, zero=3, **off)),
                                            ("out-of-offload", dict(dp=2, zero=2, **off), dict(zero=0)),
                                            ("into-ratio", dict(dp=2, zero=1, **off),
                                             dict(dp=2, zero=3, offload_ratio=0.5, **off))))


_made = {}  # (its ranks, axis, which such call of the mesh) -> process group


def lines():
    """build_mesh's new_group for one mesh, each line's group made once a launch and reused by
    every later mesh with that line: a gloo group keeps ~3 threads a rank until the end, and the
    launch builds some 150 meshes (without it, 700-1000 threads a rank by the end). Every rank
    builds the same meshes, so every rank makes the same groups. The call's count within the
    mesh keeps apart what build_mesh keeps apart (a pp line and its two directions' pairs)."""
    seen = {}

    def new_group(ranks, axis):
        key = (tuple(ranks), axis)
        seen[key] = seen.get(key, 0) + 1
        if key + (seen[key],) not in _made:
            _made[key + (seen[key],)] = dist.new_group(sorted(ranks))
        return _made[key + (seen[key],)]
    return new_group


def batch(step, first, count):
    """Global sequences first .. first + count - 1 of a step, each a function of (step, its number):
    counting from a random start in steps of 1, 2 or 3 (mod 256) -- something to learn."""
    rows = []
    for j in range(first, first + count):
        start, stride = torch.randint(0, 256, (2,), generator=torch.Generator().manual_seed(1000 * step + j)).tolist()
        rows.append((start + (1 + stride % 3) * torch.arange(T + 1)) % 256)
    xy = torch.stack(rows)
    return torch.stack([xy[:, :-1], xy[:, 1:]])


def run(rank, name, kw, steps, cfg=CFG, save=None, resume=None, until=None):
    """`steps` of the learning-rate schedule, trained up to `until` (default: all); save: (step,
    folder): a checkpoint after that step; resume: a folder whose checkpoint this run starts from."""
    pp, dp, cp, tp, b = kw.get("pp", 1), kw.pop("dp", 1), kw.get("cp", 1), kw.get("tp", 1), kw.pop("b", B)
    hold = kw.pop("hold", False)
    bf16, lean = kw.pop("bf16", False), kw.pop("lean", True)  # bf16 autocast; over a lean state, or fp32 buckets
    n = pp * dp * cp * tp
    lay = make_layout(n, cfg, seq_len=T, batch_size=b, total_batch=SEQS * T, **kw)
    comm = Comm(torch.device("cpu"))
    mesh = build_mesh(rank, n, comm, pp=pp, cp=cp, tp=tp, ep=lay.ep, ring=lay.virtual > 1, members=range(n),
                      new_group=lines())
    if mesh is None:
        return None
    parts = make_parts(cfg, mesh, lay, lay.sp)
    for part in parts:
        init_weights(part, 5)
        if lay.recompute:
            part.use_recompute()
        if lay.fp8:
            part.use_fp8(fp8.RECIPES[lay.fp8])
    engine = Engine(parts, mesh, comm, zero=lay.zero, exact=lay.exact, bucket_mb=0.01, device=torch.device("cpu"),
                    dtype=torch.bfloat16 if bf16 and lean else torch.float32, offload=lay.offload == "optimizer")
    opt = AdamW(engine, offload=lay.offload == "optimizer", ratio=lay.offload_ratio)
    if opt.offload is not None:
        opt.offload.hold = hold
    rows = lay.batch.seqs_per_rank
    tokens = torch.zeros(2, rows, T, dtype=torch.long)
    built = SimpleNamespace(layout=lay, mesh=mesh, comm=comm, cfg=SimpleNamespace(batch_size=b, seq_len=T), parts=parts,
                            mcfg=cfg, engine=engine, fault=None)
    autocast = (lambda: torch.autocast("cpu", torch.bfloat16, cache_enabled=False)) if bf16 else nullcontext
    passes = Passes(built, autocast, tokens)
    losses, norms, first = [], [], 0
    ckpt_rt, t0 = SimpleNamespace(is_main=rank == 0, rank=rank, world_size=n), time.time()
    balance = torch.zeros(cfg.n_layer, max(1, cfg.moe_experts))  # (as build.py: the experts' biases)
    for part in parts:
        part.use_expert_biases(balance)
    if resume is not None:
        first = checkpoint.load(checkpoint.list_checkpoints(resume)[-1], engine, opt)["step"]
        opt.loaded()  # (as build.py)
    for step in range(first, until or steps):
        tokens.copy_(batch(step, mesh.coord("dp") * rows, rows))
        opt.prepare(lr_at(step, lr=3e-3, warmup=2, max_steps=steps, final_frac=0.1))
        sums = passes.train_step()
        engine.finish_step()
        norm = engine.grad_norm()
        opt.update(grad_scale=clip_scale(norm, 1.0))
        engine.gather_params()
        losses.append(reduce_loss(comm, mesh, sums) / (SEQS * T))
        norms.append(norm.item())
        if cfg.moe_experts:  # (as train.py: the step's figures, and the biases moved)
            expert.step_figures(parts, comm, mesh.groups["world"], cfg, balance)
        if save is not None and step + 1 == save[0]:
            info = {"config": "", "family": cfg.family, "model": dataclasses.asdict(cfg), "tokenizer": "bytes"}
            checkpoint.save(save[1], step + 1, engine, opt, info, ckpt_rt, lay, keep=1, run_id="layouts")
    live = comm.all_gather_object(passes.executor.max_live, mesh.groups["world"])
    held = {"state_bytes": engine.model_state_bytes(), "optimizer_numel": opt.state_numel(),  # (this rank's, at rest)
            "bf16_numel": sum(b.data.numel() for b in engine.buckets if b.data.dtype == torch.bfloat16),
            "masters_apart": sum(b.master.numel() for b in engine.buckets if b.apart)}
    wte = [p for part in parts for n, p in part.named_parameters() if n == part.embedding_name and cfg.tied]
    with engine.gathered():
        wte_sha = hashlib.sha256(wte[0].detach().clone().numpy().tobytes()).hexdigest() if wte and mesh.coord("tp") == 0 else None
    copies = [s for s in comm.all_gather_object(wte_sha, mesh.groups["world"]) if s]
    pairs = comm.all_gather_object(parts[0].cp.pairs if parts[0].cp else 0, mesh.groups["world"])
    return {"losses": losses, "norms": norms, "sha": weights_sha256(engine), "live": live, "pairs": pairs,
            "balance": balance.tolist(),
            "stage_of_rank": [r // (n // pp) for r in range(n)], "micro": lay.batch.micro_steps,
            "wte_copies": len(copies), "wte_copies_equal": len(set(copies)) == 1, "seconds": time.time() - t0,
            "offload_waits": opt.offload.waits if opt.offload else None, "buckets": len(engine.buckets),
            # (every rank's: a pipeline's stages own buckets of their own)
            "owned": comm.all_gather_object(kept_or_hosted(engine, opt), mesh.groups["world"]),
            "waits": comm.all_gather_object(opt.offload.waits if opt.offload else None, mesh.groups["world"]), **held}


def kept_or_hosted(engine, opt):
    """--offload: each owned bucket's (owned elements, its chunk, its first block -- -1: none --, index,
    kept on the device: its master and moments not the host's, the tied embedding split over a pipeline's
    stages)."""
    if opt.offload is None:
        return None
    block = {m: i for part in engine.parts for i, m in enumerate(part.blocks())}
    split = engine.tied.buckets if engine.tied.partner is not None else []
    return [(p.numel(), b.stage, block[b.modules[0]] if b.modules else -1, b.index,
             not b.hosted and not any(m is p for m in opt.offload.master), b in split) for b, p, _ in engine.owned()]


def attention(rank, cp, impl, order, dtype=torch.float32):
    """Context-parallel attention on the first cp ranks against torch's on the whole sequence (each
    rank computes that reference itself): the largest error of the output and of dq, dk, dv on
    any rank, each rank's block pairs, and whether each ring transfer was launched before the
    attention of its step was done (comm's flight records against the host clock)."""
    comm = Comm(torch.device("cpu"))
    mesh = build_mesh(rank, cp, comm, cp=cp, members=range(cp), new_group=lines())
    if mesh is None:
        return None
    cx = Context(mesh.groups["cp"], impl, order)
    g = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(2, 3, 8 * cp, 8, generator=g).to(dtype) for _ in range(4))
    ref = [t.float().clone().requires_grad_() for t in (q, k, v)]  # torch's, in fp32 on the same values
    out = F.scaled_dot_product_attention(*ref, is_causal=True)
    out.backward(do.float())
    idx = token_index(8 * cp, cp, mesh.coord("cp"), order)
    mine = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    got = cx.attend(*mine)
    got.backward(do[:, :, idx])
    assert got.dtype == dtype and all(a.grad.dtype == dtype for a in mine)
    err = max([(got.float() - out[:, :, idx]).abs().max().item()] + [(a.grad.float() - b.grad[:, :, idx]).abs().max().item()
                                                                     for a, b in zip(mine, ref)])
    # each transfer launched before its step's attention began, waited for only once it was done
    overlap = all(launched <= begun <= done for launched, begun, done in cx.events) and len(cx.events) == 2 * (cp - 1)
    rows = comm.all_gather_object((err, cx.pairs, overlap), mesh.groups["world"])
    return {"err": max(r[0] for r in rows), "pairs": [r[1] for r in rows],
            "overlap": all(r[2] for r in rows) if impl == "ring" else None}


def dispatch(rank, ep, capacity):
    """One MoE layer with its experts over the first ep ranks, each rank routing its own random
    tokens, against a plain reference written here: every rank's tokens through the whole
    layer in one process (route by hand, capacity counted token by token in priority order, each
    token through its experts one by one). The largest relative error (of the largest value) of
    the output, the input's and the router's gradients and each held expert's, and whether the
    dropped assignments are the reference's."""
    comm = Comm(torch.device("cpu"))
    mesh = build_mesh(rank, ep, comm, ep=ep, members=range(ep), new_group=lines())
    if mesh is None:
        return None
    cfg = replace(MOE, moe_experts=8, moe_capacity=capacity)
    torch.manual_seed(0)
    ref = MoE(cfg, range(8), LocalDispatch())  # the whole layer, every expert (the same weights on every rank)
    layer = MoE(cfg, Dispatch(mesh.groups["ep"]).experts_of(8, mesh.coord("ep")), Dispatch(mesh.groups["ep"]))
    held = slice(layer.held.start, layer.held.stop)  # (its experts: its slice of the stacks)
    layer.load_state_dict({k: v[held] if k.startswith("experts.") else v for k, v in ref.state_dict().items()})
    g = torch.Generator().manual_seed(11)
    xs = torch.randn(ep, 2, 12, 32, generator=g)  # every rank's tokens (rank r: xs[r]); each rank its own
    dys = torch.randn(ep, 2, 12, 32, generator=g)
    x = xs[rank].clone().requires_grad_()
    y = layer(x)
    y.backward(dys[rank])
    errs, dropped_ok = [], True
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
    xr = xs.clone().requires_grad_()
    outs = []
    for r in range(ep):  # the reference: each rank's tokens a group of their own, as its capacity is
        tokens = xr[r].reshape(-1, 32)
        probs = torch.softmax(tokens @ ref.router.weight.T, -1)
        w, idx = probs.topk(2, -1)
        w = w / w.sum(-1, keepdim=True)
        cap = math.ceil(capacity * tokens.shape[0] * 2 / 8) if capacity else tokens.shape[0] * 2
        taken, keep = [0] * 8, torch.zeros(idx.shape, dtype=torch.bool)
        for slot in range(2):
            for t in range(tokens.shape[0]):
                e = int(idx[t, slot])
                if taken[e] < cap:
                    taken[e], keep[t, slot] = taken[e] + 1, True
        rows = []
        for t in range(tokens.shape[0]):
            acc = torch.zeros(32)
            for slot in range(2):
                if keep[t, slot]:
                    e, ex = int(idx[t, slot]), ref.experts
                    h = F.gelu(F.linear(tokens[t], ex.c_fc.weight[e], ex.c_fc.bias[e]), approximate="tanh")
                    acc = acc + w[t, slot] * F.linear(h, ex.c_proj.weight[e], ex.c_proj.bias[e])
            rows.append(acc)
        outs.append(torch.stack(rows).view(2, 12, 32))
        if r == rank:
            _, _, mine, _, _ = route(layer.router(x.detach().reshape(-1, 32)), 2, capacity)
            dropped_ok = torch.equal(mine, keep)
    out = torch.stack(outs)
    (out * dys).sum().backward()
    errs.append(rel(y, out[rank]))
    errs.append(rel(x.grad, xr.grad[rank]))
    # (each rank's: its tokens')
    router = comm.gather_rows(layer.router.weight.grad.reshape(-1), mesh.groups["world"]).sum(0)
    errs.append(rel(router, ref.router.weight.grad.reshape(-1)))
    for a, b in zip(layer.experts.parameters(), ref.experts.parameters()):
        errs.append(rel(a.grad, b.grad[held]))
    rows = comm.all_gather_object((max(errs), dropped_ok, int((~mine).sum())), mesh.groups["world"])
    return {"err": max(r[0] for r in rows), "dropped_ok": all(r[1] for r in rows), "dropped": sum(r[2] for r in rows)}


def main(out, suites):
    """Each suite of the comma-separated list in turn, in one process group (its startup paid
    once); rank 0 writes OUT/results_<suite>.json."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    for suite in suites.split(","):
        results = run_suite(rank, out, suite)
        if rank == 0:
            with open(f"{out}/results_{suite}.json", "w") as f:
                json.dump(results, f)
        dist.barrier()
    dist.destroy_process_group()


def run_suite(rank, out, suite):
    results = {}
    if suite == "cp":
        for cp in (2, 4):
            for impl in ("ring", "allgather"):
                for order in ("zigzag", "contiguous"):
                    r = attention(rank, cp, impl, order)
                    if rank == 0:
                        results[f"attention-cp{cp}-{impl}-{order}"] = r
                    dist.barrier()
        r = attention(rank, 2, "ring", "zigzag", torch.bfloat16)  # bf16 in and out, fp32 inside
        if rank == 0:
            results["bf16-attention-cp2-ring-zigzag"] = r
        dist.barrier()
    if suite == "ep":
        for ep in (2, 4):
            for capacity in (1.0, 0.0):
                r = dispatch(rank, ep, capacity)
                if rank == 0:
                    results[f"dispatch-ep{ep}-capacity{capacity}"] = r
                dist.barrier()
    if suite == "matrix":
        results = matrix(rank, out)
    if suite == "offload":
        results = offload_resumes(rank, out)
    if suite == "lean":
        results = lean_resumes(rank, out)
    for name, kw, steps in layouts(suite) if suite != "matrix" else ():
        kw = dict(kw)
        cfg = {"free": replace(MOE, moe_capacity=0.0, moe_aux=0.0), "tied": LLAMA_TIED, "mix": MIXTRAL,
               "mix-bias": MIXTRAL_BIAS, "shallow": SHALLOW, "llama": LLAMA,
               None: {"ep": MOE, "tp": SHALLOW, "cp": SHALLOW, "llama": LLAMA, "offload": MOE, "lean": MOE}.get(suite, CFG)
               }[kw.pop("cfg", None)]
        r = run(rank, name, kw, steps, cfg)
        if rank == 0:
            results[name] = r
        dist.barrier()
    return results


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    os._exit(0)  # no interpreter teardown after collectives: see braidtrain.cli.run
