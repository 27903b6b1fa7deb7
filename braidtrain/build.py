"""Setting a run up, in the order each part needs the ones before it:

    runtime (who am I) -> data -> model shape -> layout (validated, before any process group)
    -> process group -> mesh -> model -> engine -> optimizer -> run directory -> guard -> resume

`build(cfg)` returns the parts (a Run); train.py's Trainer drives them.
"""

from __future__ import annotations

import json
import os
import time
import tomllib
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import torch

from braidtrain import layout
from braidtrain.io import checkpoint, export, rundir
from braidtrain.collective.comm import Comm
from braidtrain.config import Config, batch_scaled
from braidtrain.io.data import LLAMA3_IDS, Loader, TokenData, data_tokenizer, get_tokenizer, resolve_files
from braidtrain.errors import UserError
from braidtrain.collective.fault import Guard
from braidtrain.collective.inject import Fault
from braidtrain.collective.mesh import Mesh, build_mesh
from braidtrain.model import flash4, fp8, registry
from braidtrain.model.protocol import ModelConfig
from braidtrain.model.stage import Stage
from braidtrain.optim import AdamW
from braidtrain.parallel import placement
from braidtrain.parallel.context import Context
from braidtrain.parallel.engine import Engine
from braidtrain.parallel.expert import Dispatch
from braidtrain.plan.search import auto_layout
from braidtrain.collective.runtime import Runtime, find_runtime


@dataclass
class Run:
    cfg: Config
    rt: Runtime
    layout: layout.Layout
    mesh: Mesh
    comm: Comm
    mcfg: ModelConfig
    parts: list[Stage]  # the model, or the pipeline chunks this rank holds
    engine: Engine
    opt: AdamW
    tok_name: str
    train_data: TokenData
    loader: Loader
    val_loader: Loader
    out: Path
    run_id: str  # rundir.py: the run its directory and checkpoints belong to
    out_lock: int | None  # rank 0: the run directory's lock, held while this process lives
    balance: torch.Tensor  # --moe-balance bias: every MoE layer's expert biases (n_layer, E); each layer's bias a row
    guard: Guard
    fault: Fault | None
    bf16: bool
    start_step: int = 0
    load_s: float | None = None


def build(cfg: Config) -> Run:
    """The run's parts; its `cfg` is the config resolved for this run (the caller's is not changed): a
    torchrun restart resumes, --layout auto's choices, -x -1's steps."""
    rt = find_runtime(cfg.init_method, num_processes=cfg.num_processes, process_rank=cfg.process_rank,
                      gpus_per_node=cfg.gpus_per_node, server=cfg.server, fs_path=cfg.fs_path,
                      device=cfg.device, timeout_s=cfg.timeout)
    if cfg.resume is None and rt.attempt > 0:  # torchrun restarted the group: carry on
        cfg = replace(cfg, resume="auto")
    fault = Fault.from_env(rt.rank, rt.attempt)  # test hook; None in real runs
    device = rt.device
    train_files = resolve_files(cfg.train_data, "train")
    val_files = resolve_files(cfg.val_data or cfg.train_data, "val")
    tok_name, vocab = data_tokenizer(train_files, cfg.tokenizer)
    if tok_name == "llama3" and cfg.sample_tokens:
        get_tokenizer(tok_name)  # its BPE file missing: say so now, not after the training
    if tok_name == LLAMA3_IDS:
        rt.log(f"note: {train_files[0]} is llama-3's layout with no tokenizer.json beside it: training on its ids "
               f"(a vocabulary of {vocab}); samples print as ids")
    if cfg.init_from:
        mcfg = hf_model_config(cfg, vocab)
    else:
        mcfg = registry.model_config(cfg.model, vocab, **model_fields(cfg))
    if cfg.layout == "auto":
        per_node = cfg.gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None
        chosen, said = auto_layout(cfg, mcfg, rt.world_size, device.type, per_node)
        cfg = replace(cfg, **chosen)
        rt.log(f"braidtrain: {said}")
    lay = layout.from_config(cfg, rt.world_size, mcfg, device.type)
    cfg = batch_scaled(cfg, lay.batch.total_tokens)
    if cfg.recipe:  # (config.py's build_config: the optimizer's settings and where they came from)
        rt.log(f"braidtrain: recipe: {cfg.recipe}")
    if cfg.cuda_graph and fault:  # the test hook acts in Python, which a replay does not run
        raise UserError("BRAIDTRAIN_FAULT cannot act inside a captured step: unset it, or drop --cuda-graph")
    # Data parallelism alone: each collective is a bucket (megabytes) or a few numbers a step, so
    # NCCL's Simple protocol for all (ZeRO-3 faster, ZeRO-0/1 unchanged: docs/design-notes.md).
    # tp's many mid-sized messages a layer keep NCCL's own choice, where LL/LL128's lower latency pays.
    rt.join(nccl_protocol="Simple" if lay.data_parallel_only else None)
    if cfg.exact:
        # same kernels, same reduction orders on every rank and every layout
        ours = "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        if ours and device.type == "cuda":
            _cublas_checked(device)
        # ... but not torch's NaN-filling of every new buffer (a pass over all memory it hands
        # out): nothing here reads memory it has not written (bucket padding is zeroed)
        torch.utils.deterministic.fill_uninitialized_memory = False
        if device.type == "cpu":
            torch.set_num_threads(1)
    bf16 = computes_in_bf16(cfg, device)

    comm = Comm(device)
    mesh = build_mesh(rt.rank, rt.world_size, comm, pp=lay.pp, cp=lay.cp, tp=lay.tp, ep=lay.ep, new_group=rt.new_group,
                      ring=ring(lay, cfg.live_recovery))
    out, session, run_id, out_lock = resolve_out(cfg, rt, comm, mesh)  # (before the model: a refusal costs nothing)
    train_data, val_data = TokenData(train_files, vocab), TokenData(val_files, vocab)
    loader = Loader(train_data, cfg.seq_len, lay.batch.seqs_per_step, cfg.seed)
    val_loader = Loader(val_data, cfg.seq_len, lay.batch.seqs_per_step, cfg.seed)
    if cfg.max_steps == -1:  # llm.c's default: one epoch of the training data
        cfg = replace(cfg, max_steps=max(1, loader.n_chunks // lay.batch.seqs_per_step))

    parts = make_parts(mcfg, mesh, lay, cfg.sp)
    if lay.fp8 and mcfg.moe_experts:
        rt.log(f"note: --fp8 {lay.fp8} leaves the experts in {'bf16' if bf16 else 'fp32'}: their grouped GEMM has no "
               f"float8 path yet (attention's projections and the dense MLPs are float8)")
    full = export.load_hf(cfg.init_from, mcfg) if cfg.init_from else None
    for part in parts:
        placement.init_weights(part, cfg.seed)
        if full is not None:  # before the engine: under ZeRO-3 a rank then holds only its shard
            table = placement.build(part)
            part.load_state_dict({n: table.local(table[n], full[n]) for n, _ in part.named_parameters()})
        settle(part, cfg, lay, device)
        part.to(device)
    balance = torch.zeros(mcfg.n_layer, max(1, mcfg.moe_experts), device=device)
    for part in parts:
        part.use_expert_biases(balance)
    engine = Engine(parts, mesh, comm, zero=cfg.zero, exact=cfg.exact, bucket_mb=cfg.bucket_mb, device=device,
                    dtype=torch.bfloat16 if bf16 else torch.float32,  # (bf16: a lean state, parallel/buckets.py)
                    offload=lay.offload == "optimizer")
    opt = AdamW(engine, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
                offload=lay.offload == "optimizer", ratio=lay.offload_ratio)

    guard = Guard(rt, comm, out / "flight", session, cfg.heartbeat_timeout, cfg.preempt_budget)
    guard.start()
    run = Run(cfg, rt, lay, mesh, comm, mcfg, parts, engine, opt, tok_name, train_data, loader, val_loader, out,
              run_id, out_lock, balance, guard, fault, bf16)
    try:
        resume(run)
        if rt.is_main:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.toml").write_text(cfg.to_toml())
            if cfg.save:
                check_space(run)
        comm.barrier(mesh.groups["world"])
    except BaseException:
        guard.close(clean=False)
        raise
    return run


def settle(part: Stage, cfg: Config, lay: layout.Layout, device) -> None:
    """A part's settings for this run, before it moves to `device`: recompute, the attention kernel
    (exact mode's on the GPU; else flash-attn-4's where it runs, model/flash4.py, unless --attention sdpa),
    float8, the fused operators (model/swiglu.py's SwiGLU, model/rmsnorm.py's norms: on CUDA only; not
    under --exact, whose bits are the plain expressions' kernels', nor --fp8, not measured with its
    casts), compile."""
    if cfg.recompute:
        part.use_recompute()
    if cfg.exact and device.type == "cuda":
        part.use_attention("exact")
    elif (cfg.attention != "sdpa" and flash4.available(device) and flash4.fits(part.cfg.head_dim)
          and computes_in_bf16(cfg, device)):  # (its kernels: bf16 or fp16, some head sizes)
        part.use_attention("flash4")
    if lay.fp8:
        part.use_fp8(fp8.RECIPES[lay.fp8])
    if device.type == "cuda" and not cfg.exact and not lay.fp8:
        part.use_fused_kernels()
    if cfg.compile:
        _inductor_on_a_baseline_cpu(device)
        part.compile_blocks()


def computes_in_bf16(cfg: Config, device) -> bool:
    """--dtype: bf16 autocast (and a lean state's bf16 weights), or fp32; auto: bf16 on a GPU."""
    return cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda")


def check_space(run: Run) -> None:
    """(Rank 0, at the start.) One line when the disk under --out cannot hold the checkpoints the
    run will keep at once: a checkpoint holds each parameter and its two Adam moments in fp32."""
    cfg, ckpts = run.cfg, run.out / "checkpoints"
    mine = [p for p in checkpoint.list_checkpoints(ckpts) if checkpoint.run_of(p) in (run.run_id, None)]
    saves = 1 + sum(1 for s in range(run.start_step + 1, cfg.max_steps) if cfg.ckpt_every and s % cfg.ckpt_every == 0)
    copies = max(min(len(mine) + saves, cfg.keep_ckpts + 1) - len(mine), 1)  # (one more while a save rotates)
    line = rundir.space_warning(run.out, 12 * run.mcfg.num_params(), copies, cfg.keep_ckpts)
    if line:
        run.rt.log(line)


def _cublas_checked(device) -> None:
    """torch runs cuBLAS under deterministic algorithms only with CUBLAS_WORKSPACE_CONFIG :4096:8 or
    :16:8 -- checked once, remembered -- but while the variable is set, torch 2.11's cuBLAS calls
    cost the host more time a matmul, deterministic algorithms on or off (docs/performance-history.md).
    On compute
    capability 9.0 torch's own workspace, which it hands cuBLAS with every call, is that size (32 MiB)
    without the variable: there, one matmul passes the check and the variable this run set goes.
    Elsewhere it stays: without it the workspace, and so perhaps the bits, would differ."""
    if torch.cuda.get_device_capability(device) != (9, 0):
        return
    a = torch.ones(16, 16, device=device)
    torch.addmm(a[0], a, a)
    del os.environ["CUBLAS_WORKSPACE_CONFIG"]


def _inductor_on_a_baseline_cpu(device) -> None:
    """torch.compile on a CPU that torch runs at its baseline capability (ATEN_CPU_CAPABILITY=default,
    or a processor without AVX2): inductor 2.13 then still emits at::vec code for some reductions,
    which does not compile at that capability (`'at::vec' has not been declared`); scalar code
    (simdlen 1) does. Process-wide, as inductor's configuration is."""
    if device.type == "cpu" and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        from torch._inductor import config as inductor

        inductor.cpp.simdlen = 1


def ring(lay: layout.Layout, live: bool) -> bool:
    """Whether the mesh pairs the last pipeline stage with the first: the interleaved schedule's
    transfers, and under live recovery the tied embedding's exchange (parallel/tied.py)."""
    return lay.virtual > 1 or (live and lay.pp > 2)


def make_parts(mcfg: ModelConfig, mesh: Mesh, lay: layout.Layout, sp: bool) -> list[Stage]:
    """The model, or with a pipeline the chunks of this rank: r, r + pp, ... (parallel/pipeline.py);
    with expert parallelism, its experts' dispatch over the ep group (parallel/expert.py); under
    context parallelism, with this rank's Context (parallel/context.py)."""
    dispatch = Dispatch(mesh.groups["ep"]) if lay.ep > 1 else None
    if lay.pp == 1:
        parts = [registry.build(mcfg, mesh, sp, dispatch=dispatch)]
    else:
        parts = registry.pipeline_chunks(mcfg, lay.split, lay.pp, mesh.coord("pp"), mesh, sp, dispatch)
    if lay.cp > 1:
        cp = Context(mesh.groups["cp"], lay.cp_impl, lay.cp_order, lay.exact)
        for part in parts:
            part.use_context(cp)
    for part in parts:
        part.use_experts(lay.exact, 1.0 / lay.batch.total_tokens)
    return parts


def model_fields(cfg: Config) -> dict:
    """The model config's fields the run sets (None: the preset's)."""
    return {k: getattr(cfg, k) for k in registry.FLAGS}


def hf_model_config(cfg: Config, vocab: int) -> ModelConfig:
    """--init-from: the model's family and shape are the HF folder's; sizes given too must agree."""
    fam, fields = export.read_config(cfg.init_from)
    for k in ("n_layer", "n_head", "n_embd", "block_size", "n_kv_heads"):
        if getattr(cfg, k) not in (None, fields.get(k)):
            raise UserError(f"--{k.replace('_', '-')} {getattr(cfg, k)} disagrees with --init-from {cfg.init_from} "
                            f"({k} = {fields.get(k)}): drop it")
    if fields["vocab_size"] != vocab:
        raise UserError(f"--init-from {cfg.init_from} has a vocabulary of {fields['vocab_size']} tokens but the data's "
                        f"tokenizer has {vocab}: use data prepared with the model's tokenizer")
    if cfg.moe_experts and cfg.moe_experts != fields.get("moe_experts", 0):
        raise UserError(f"--moe-experts {cfg.moe_experts} disagrees with --init-from {cfg.init_from} "
                        f"({fields.get('moe_experts', 0)} experts): drop it")
    mcfg = fam.Config(**fields)
    mcfg.check()
    return mcfg


def resolve_out(cfg: Config, rt, comm: Comm, mesh: Mesh) -> tuple[Path, float, str, int | None]:
    """The run directory, the same on every rank, claimed for this run by rank 0 (rundir.py: a new
    run into another's directory stops here, on every rank, in one line): rank 0 picks the
    timestamp, and a group that torchrun restarts finds the one its first attempt picked
    (torchrun's store outlives the restart). Also this session's id, rank 0's clock now: it tells
    doctor which flight logs belong to one incident; the run's id; on rank 0, the directory's lock
    (a file descriptor, held open for the run)."""
    out, claimed, fd = cfg.out, None, None
    if rt.is_main:
        if out is None:
            out = f"runs/{datetime.now().strftime('%Y%m%d-%H%M%S')}"
            if rt.launch_store is not None:
                out = rt.launch_store.compare_set("out", "", out).decode()  # the first attempt's wins
        try:
            claimed, fd = rundir.claim(Path(out), bool(cfg.resume), cfg.start_over, rt.log)
        except UserError as e:
            claimed = e
    out, session, claimed = comm.broadcast_object((out, time.time(), claimed), mesh.groups["world"])
    if isinstance(claimed, UserError):
        raise claimed
    return Path(out), session, claimed, fd


# a checkpoint's layout from before pp, cp, ep
BEFORE = {"pp": 1, "cp": 1, "cp_impl": "ring", "cp_order": "zigzag", "ep": 1}


# how a process runs, not what it trains
PROCESS_ONLY = ("resume", "start_over", "live_recovery", "join", "preempt_budget")
# where the optimizer's settings came from: they are compared themselves
SAID_ELSEWHERE = ("recipe", "recipe_batch")


def what_changed(meta: dict, now: dict, cfg: Config) -> str:
    """'world_size 4 -> 2, zero 1 -> 3, ...': how this run differs from the one that saved."""
    layout = {**BEFORE, **meta["layout"]}
    diff = [f"{k} {layout.get(k)} -> {v}" for k, v in now.items() if layout.get(k) != v]
    saved = tomllib.loads(meta.get("config", ""))
    mine = tomllib.loads(cfg.to_toml())
    diff += [f"{k} {saved.get(k)} -> {mine.get(k)}" for k in sorted(set(saved) | set(mine))
             if k not in now and k not in PROCESS_ONLY + SAID_ELSEWHERE and saved.get(k) != mine.get(k)]
    return ", ".join(diff)


def resume(run: Run) -> None:
    cfg, rt = run.cfg, run.rt
    if not cfg.resume:
        return
    ckpt_dir = run.out / "checkpoints"
    if rt.attempt > 0:
        rt.log(f"torchrun restart {rt.attempt}: resuming from the newest valid checkpoint in {ckpt_dir}")
    path = checkpoint.find_resume(cfg.resume, ckpt_dir, rt.log)
    if path is None:
        rt.log(f"no checkpoint in {ckpt_dir}: starting from step 0")
        return
    saved_step = json.loads((path / "meta.json").read_text())["step"]  # (find_resume verified it)
    if saved_step > cfg.max_steps:  # (its weights would be saved, and named, as step max_steps)
        raise UserError(f"{path} holds step {saved_step}, past this run's -x {cfg.max_steps}: give a larger -x to "
                        f"train on from it (-x {saved_step} only writes its summary)")
    t0 = time.time()
    meta = checkpoint.load(path, run.engine, run.opt)
    run.opt.loaded()  # (an offloaded optimizer's master follows the weights read)
    if "moe_bias" in meta:  # --moe-balance bias: the experts' biases as they were
        run.balance.copy_(torch.tensor(meta["moe_bias"], device=run.balance.device))
    run.start_step, run.load_s = meta["step"], time.time() - t0
    now = checkpoint.layout_record(run.layout, rt.world_size)
    changed = what_changed(meta, now, cfg)
    rt.log(f"resumed from {path} (step {run.start_step}) in {run.load_s:.2f} s"
           + (f"; changed since the save: {changed}" if changed else "; same layout and config"))
    for axis in ("tp", "cp", "cp_impl", "cp_order"):  # what sets the order of the model's own sums (ep does not)
        saved, mine = {"tp": 1, **BEFORE, **meta["layout"]}[axis], getattr(run.layout, axis)
        if cfg.exact and saved != mine:
            rt.log(f"note: --exact is bitwise across dp, ZeRO and restarts at a fixed {axis}; this run resumes a "
                   f"{axis}={saved} checkpoint at {axis}={mine}, so from here on its bits differ from a run that "
                   f"stayed at {axis}={saved}")
