"""The training loop: runtime -> mesh -> model -> engine -> optimizer, then steps.

One step, on every rank:

    for each of its micro-batches (a contiguous block of the step's global sequences):
        forward -> sum of the token losses -> divide by the *global* token count -> backward
        (on the last micro-batch, each bucket's reduction starts as soon as its gradients are in)
    wait for the reductions -> global grad norm -> clip and AdamW (torch's fused kernel) on what
    this rank owns -> (ZeRO-1/2) all-gather the updated parameters -> log

Everything from the first forward to the all-gather (Trainer.work) launches the same kernels
with the same arguments every step -- the tokens sit in one device buffer, the learning rate in a
device scalar -- so --cuda-graph captures it once, after GRAPH_WARMUP eager steps, and replays it:
the host then issues one launch per step instead of thousands. On several GPUs the graph holds the
step's NCCL collectives too.

The norm and the clipping factor stay on the device and the step's tokens are copied once from
pinned memory, so the host runs ahead of the GPU through the whole step; it reads the next
step's tokens while the GPU works, then waits once, at the end, to read the loss for the log.

Python's garbage collector runs only by hand during the loop (collect_garbage), at the same steps
on every rank: a full collection among torch.compile's objects takes 0.2-0.3 s (measured on CPU),
and one that struck a single rank inside a step would hold its peers in the next collective.

Around the loop, fault.Guard watches the peers (heartbeat) and writes this rank's flight log when
the rank crashes, is signalled, or loses a peer; a group that torchrun restarts resumes by itself
from the newest checkpoint (docs/fault-tolerance.md).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import time
import tomllib
from contextlib import contextmanager, nullcontext
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from braidtrain import checkpoint, export
from braidtrain.comm import Comm, pairwise_sum
from braidtrain.config import Config, plan_batch
from braidtrain.data import Loader, TokenData, data_tokenizer, get_tokenizer, resolve_files, unigram_entropy
from braidtrain.errors import UserError
from braidtrain.fault import Fault, Guard, crash_reason
from braidtrain.mesh import build_mesh
from braidtrain.metrics import MetricsLog, Progress, finite, peak_flops, plot_runs
from braidtrain.model import attention
from braidtrain.model.gpt import GPT, check_tp, init_weights, model_config
from braidtrain.model.layers import shard_of
from braidtrain.optim import AdamW, clip_scale, lr_at
from braidtrain.parallel.data import DataParallel
from braidtrain.runtime import init_runtime

GRAPH_WARMUP = 2  # --cuda-graph: eager steps before the capture (compilation, lazy initialisation)
GC_EVERY = 20  # steps between two collections of Python garbage (collect_garbage)


@contextmanager
def gc_by_hand():
    """Python's automatic collector off (Trainer.collect_garbage runs it), then back as it was,
    with what collect_garbage froze thawed -- unless the caller had frozen objects of its own."""
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    gc.disable()
    try:
        yield
    finally:
        if not frozen:
            gc.unfreeze()
        if enabled:
            gc.enable()


def check_exact(dp: int, micro: int, unit: int) -> None:
    """Exact mode needs the canonical tree: dp a power of two, and (when dp > 1) a power-of-two
    number of micro-steps per rank so that each rank holds one complete subtree."""
    pow2 = lambda n: n & (n - 1) == 0
    if not pow2(dp):
        raise UserError(f"--exact needs a power-of-two data-parallel size, got dp={dp}: use 1, 2, 4, 8 ... processes")
    if dp > 1 and not pow2(micro):
        lo = 1 << (micro.bit_length() - 1)
        raise UserError(
            f"--exact with dp={dp} needs a power-of-two number of micro-steps per rank, got d/(b*t*dp) = {micro}: "
            f"use -d {lo * unit} or -d {2 * lo * unit}"
        )


def resolve_out(cfg: Config, rt, comm: Comm) -> tuple[Path, float]:
    """The run directory, the same on every rank: rank 0 picks the timestamp, and a group that
    torchrun restarts finds the one its first attempt picked (torchrun's store outlives the
    restart). Also this session's id, rank 0's clock now: it tells doctor which flight logs
    belong to one incident."""
    out = cfg.out
    if out is None and rt.is_main:
        out = f"runs/{datetime.now().strftime('%Y%m%d-%H%M%S')}"
        if rt.launch_store is not None:
            out = rt.launch_store.compare_set("out", "", out).decode()  # the first attempt's wins
    got = [out, time.time()]
    if rt.world_size > 1:
        comm.sync("broadcast_object", "world", lambda: dist.broadcast_object_list(got, src=0))
    return Path(got[0]), got[1]


def what_changed(meta: dict, layout: dict, cfg: Config) -> str:
    """'world_size 4 -> 2, zero 1 -> 3, ...': how this run differs from the one that saved."""
    diff = [f"{k} {meta['layout'].get(k)} -> {v}" for k, v in layout.items() if meta["layout"].get(k) != v]
    saved = tomllib.loads(meta.get("config", ""))
    now = tomllib.loads(cfg.to_toml())
    diff += [f"{k} {saved.get(k)} -> {now.get(k)}" for k in sorted(set(saved) | set(now))
             if k not in layout and k != "resume" and saved.get(k) != now.get(k)]
    return ", ".join(diff)


def hf_model_config(cfg: Config, vocab: int):
    """--init-from: the model's shape is the HF folder's; explicit sizes must agree with it."""
    c = export.read_config(cfg.init_from)
    dims = {"n_layer": c["n_layer"], "n_head": c["n_head"], "n_embd": c["n_embd"], "block_size": c["n_positions"]}
    for k, v in dims.items():
        if getattr(cfg, k) not in (None, v):
            raise UserError(f"--{k.replace('_', '-')} {getattr(cfg, k)} disagrees with --init-from {cfg.init_from} ({k} = {v}): drop it")
    if c["vocab_size"] != vocab:
        raise UserError(f"--init-from {cfg.init_from} has a vocabulary of {c['vocab_size']} tokens but the data's "
                        f"tokenizer has {vocab}: use data prepared with the model's tokenizer")
    return model_config(cfg.model, vocab, **dims)


def tp_shards(model, full: dict) -> dict:
    """This tp rank's shards of full tensors (wte padded with zero rows to this layout's vocabulary)."""
    if model.tp == 1:
        return full
    out = {}
    for name, t in full.items():
        if name == "wte.weight":
            t = torch.cat([t, t.new_zeros(model.cfg.vocab_rows(model.tp) - t.shape[0], t.shape[1])])
        out[name] = shard_of(t, model.shard_spec(name), model.tp_rank, model.tp)
    return out


def gather_loss(comm: Comm, engine: DataParallel, local: list[torch.Tensor]) -> float:
    """Sum of per-micro-batch loss sums over all ranks, along one fixed tree (any layout, same bits)."""
    t = torch.stack(local).double() if local else torch.zeros(0, dtype=torch.float64)
    rows = comm.gather_rows(t, engine.group, "replica")
    return pairwise_sum(rows.reshape(-1)).item()


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        rt = self.rt = init_runtime(
            cfg.init_method, num_processes=cfg.num_processes, process_rank=cfg.process_rank,
            gpus_per_node=cfg.gpus_per_node, server=cfg.server, fs_path=cfg.fs_path,
            device=cfg.device, timeout_s=cfg.timeout,
            # Data parallelism alone: each collective is a bucket (megabytes) or a few numbers a
            # step, so NCCL's Simple protocol for all: ZeRO-3 on two H200s 7-14% faster, ZeRO-0/1
            # unchanged (docs/performance.md). tp's many mid-sized messages a layer keep NCCL's
            # own choice, where LL/LL128's lower latency pays.
            nccl_protocol="Simple" if cfg.tp == 1 else None,
        )
        if cfg.resume is None and rt.attempt > 0:  # torchrun restarted the group: carry on
            cfg.resume = "auto"
        self.fault = Fault.from_env(rt.rank, rt.attempt)  # test hook; None in real runs
        self.device = rt.device
        if cfg.cuda_graph and self.device.type != "cuda":
            raise UserError(f"--cuda-graph needs a GPU (this run is on {self.device.type}): drop --cuda-graph")
        if cfg.cuda_graph and self.fault:  # the test hook acts in Python, which a replay does not run
            raise UserError("BRAIDTRAIN_FAULT cannot act inside a captured step: unset it, or drop --cuda-graph")
        if cfg.exact:
            # same kernels, same reduction orders on every rank and every layout
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            # ... but not torch's NaN-filling of every new buffer (a pass over all memory it hands
            # out): nothing here reads memory it has not written (bucket padding is zeroed)
            torch.utils.deterministic.fill_uninitialized_memory = False
            if self.device.type == "cpu":
                torch.set_num_threads(1)
        self.bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and self.device.type == "cuda")
        if self.bf16 and self.device.type == "cpu" and cfg.dtype == "auto":
            self.bf16 = False

        # data and model
        train_files = resolve_files(cfg.train_data, "train")
        val_files = resolve_files(cfg.val_data or cfg.train_data, "val")
        self.tok_name, vocab = data_tokenizer(train_files, cfg.tokenizer)
        if cfg.init_from:
            self.mcfg = hf_model_config(cfg, vocab)
        else:
            self.mcfg = model_config(cfg.model, vocab, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size)
        if cfg.seq_len > self.mcfg.block_size:
            raise UserError(f"-t {cfg.seq_len} is longer than the model's context ({self.mcfg.block_size}): use -t {self.mcfg.block_size} or less")
        check_tp(self.mcfg, cfg.tp, cfg.sp, cfg.seq_len)
        self.mesh = build_mesh(rt.rank, rt.world_size, tp=cfg.tp)
        self.dp = self.mesh.size("replica")
        self.plan = plan_batch(cfg, self.dp)
        if cfg.exact:
            check_exact(self.dp, self.plan.micro_steps, cfg.batch_size * cfg.seq_len * self.dp)
        self.train_data = TokenData(train_files, vocab)
        self.val_data = TokenData(val_files, vocab)
        self.loader = Loader(self.train_data, cfg.seq_len, self.plan.seqs_per_step, cfg.seed)
        self.val_loader = Loader(self.val_data, cfg.seq_len, self.plan.seqs_per_step, cfg.seed)
        if cfg.max_steps == -1:  # llm.c's default: one epoch of the training data
            cfg.max_steps = max(1, self.loader.n_chunks // self.plan.seqs_per_step)

        model = GPT(self.mcfg, mesh=self.mesh, sp=cfg.sp)
        init_weights(model, cfg.seed)
        if cfg.init_from:  # before the engine: under ZeRO-3 a rank then holds only its shard
            model.load_state_dict(tp_shards(model, export.load_hf(cfg.init_from, self.mcfg)))
        model.recompute = cfg.recompute
        if cfg.exact and self.device.type == "cuda":
            if not attention.available(self.device):
                raise UserError("--exact on GPU needs triton (for the deterministic attention): pip install triton")
            head = self.mcfg.n_embd // self.mcfg.n_head
            if head not in attention.HEAD_DIMS:
                raise UserError(f"--exact on GPU supports head sizes {attention.HEAD_DIMS} (n_embd / n_head), "
                                f"got {self.mcfg.n_embd} / {self.mcfg.n_head} = {head}: change --n-head, or drop --exact")
            model.use_deterministic_attention()
        if cfg.compile:
            model.compile_blocks()
        self.model = model.to(self.device)
        self.comm = Comm(self.device)
        self.engine = DataParallel(self.model, self.mesh, self.comm, zero=cfg.zero, exact=cfg.exact,
                                   bucket_mb=cfg.bucket_mb, device=self.device)
        self.opt = AdamW(self.engine, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
        self.shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        self.tokens = torch.zeros((2, self.plan.seqs_per_rank, cfg.seq_len), dtype=torch.long, device=self.device)  # x, y
        self.next_tokens = None, None  # (step, its host_tokens), read ahead
        self.graph = self.graph_out = self.graph_handles = None  # --cuda-graph: the captured step, its outputs and collectives

        self.out, session = resolve_out(cfg, rt, self.comm)
        self.ckpt_dir = self.out / "checkpoints"
        self.guard = Guard(rt, self.comm, self.out / "flight", session, cfg.heartbeat_timeout)
        self.guard.start()
        try:
            self.resume()
            if rt.is_main:
                self.out.mkdir(parents=True, exist_ok=True)
                (self.out / "config.toml").write_text(cfg.to_toml())
            self.comm.sync("barrier", "world", rt.barrier)
        except BaseException:
            self.guard.close(clean=False)
            raise

    def resume(self) -> None:
        cfg, rt = self.cfg, self.rt
        self.start_step, self.load_s = 0, None
        if not cfg.resume:
            return
        if rt.attempt > 0:
            rt.log(f"torchrun restart {rt.attempt}: resuming from the newest valid checkpoint in {self.ckpt_dir}")
        path = checkpoint.find_resume(cfg.resume, self.ckpt_dir, rt.log)
        if path is None:
            return
        t0 = time.time()
        meta = checkpoint.load(path, self.engine, self.opt, self.model)
        self.start_step, self.load_s = meta["step"], time.time() - t0
        layout = {"world_size": rt.world_size, "dp": self.dp, "zero": cfg.zero, "tp": cfg.tp}
        changed = what_changed(meta, layout, cfg)
        rt.log(f"resumed from {path} (step {self.start_step}) in {self.load_s:.2f} s"
               + (f"; changed since the save: {changed}" if changed else "; same layout and config"))

    def autocast(self):
        # no weight-cast cache: each block uses its weights once per forward, and a cache would
        # outlive a captured graph's region (--cuda-graph)
        if self.bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, cache_enabled=False)
        return nullcontext()

    # -- one optimizer step ---------------------------------------------------------------------
    def step(self, step: int) -> dict:
        cfg, plan, engine = self.cfg, self.plan, self.engine
        t0 = time.time()
        self.comm.step = step + 1  # stamped on this step's flight records
        # this rank's sequences of the step, read while the previous step ran on the GPU, copied
        # once and asynchronously
        nxt, xy = self.next_tokens
        self.tokens.copy_(xy if nxt == step else self.host_tokens(step), non_blocking=True)
        lr = lr_at(step, lr=cfg.lr, warmup=cfg.warmup_steps, max_steps=cfg.max_steps, final_frac=cfg.final_lr_frac)
        self.opt.prepare(lr)
        if cfg.cuda_graph and self.graph is None and step >= self.start_step + GRAPH_WARMUP:
            # the warm-up steps compiled the blocks and set every lazy state; the capture records
            # the step's kernels without running them, each replay runs them
            self.graph, before = torch.cuda.CUDAGraph(), len(self.comm.step_handles)
            with torch.cuda.graph(self.graph):
                self.graph_out = self.work()
            self.graph_handles = self.comm.step_handles[before:]  # the collectives it captured
            self.comm.step_handles = self.comm.step_handles[:before]
        if self.graph is not None:
            self.graph.replay()
            self.comm.replayed(self.graph_handles)
            losses, norm = self.graph_out
        else:
            losses, norm = self.work()
        host_s = time.time() - t0  # the step's work issued; nothing has waited for the GPU yet
        if step + 1 < cfg.max_steps:  # while the GPU works: the next step's tokens
            self.next_tokens = step + 1, self.host_tokens(step + 1)
        self.collect_garbage(step)
        loss = gather_loss(self.comm, engine, losses) / plan.total_tokens
        dt = time.time() - t0
        tps = plan.total_tokens / dt
        peak = peak_flops(self.device, self.bf16)
        mfu = self.mcfg.flops_per_token(cfg.seq_len) * tps / (peak * self.rt.world_size) if peak else None
        if self.device.type == "cuda":
            mem = torch.cuda.max_memory_allocated(self.device) / 1e9
        else:
            mem = (engine.model_state_bytes() + 2 * 4 * self.opt.state_numel()) / 1e9
        comm_s, bus_bytes = self.comm.step_comm()
        return {"step": step + 1, "loss": finite(loss), "lr": lr, "grad_norm": finite(norm.item()),
                "tokens_per_s": tps, "mfu": mfu, "mem_gb": mem, "step_s": dt, "host_s": host_s, "comm_s": comm_s,
                "comm_busbw_GBps": bus_bytes / comm_s / 1e9 if bus_bytes and comm_s > 0 else None,
                "exposed_comm_s": engine.exposed_comm_s()}

    def drop_graph(self, wait: bool = True) -> None:
        """Free the captured step: its memory, and its hold on the NCCL communicator (with a graph
        of collectives alive to the end, the two-GPU runs hung at exit). `wait`: for the GPU to
        finish first (not on an error path, where a collective may never end)."""
        if self.graph is not None:
            if wait:
                torch.cuda.synchronize(self.device)
            self.graph.reset()
            self.graph = self.graph_out = self.graph_handles = None

    def collect_garbage(self, step: int) -> None:
        """Python's cyclic garbage, collected on every rank at the same steps and while the GPU
        works (the automatic collector is off during the loop: gc_by_hand). After the first step
        everything alive -- the model, torch.compile's graphs and caches -- is frozen: later
        collections scan only what was made since (gpt2 --compile: 0.2 ms, against 240 ms for the
        first one with its 410k objects)."""
        if step == self.start_step:
            gc.collect()
            gc.freeze()
        elif (step - self.start_step) % GC_EVERY == 0:
            gc.collect()

    def host_tokens(self, step: int) -> torch.Tensor:
        """(2, sequences, T): this rank's inputs and targets of a step, in pinned memory on GPU
        runs (a copy from pageable memory would make the host wait for the GPU)."""
        rows = self.plan.seqs_per_rank
        xy = torch.stack(self.loader.batch(step, self.engine.rank * rows, rows))
        return xy.pin_memory() if self.device.type == "cuda" else xy

    def work(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The step's device work, from the tokens in self.tokens to updated parameters: the
        same kernels with the same arguments every step (what --cuda-graph captures). Returns
        the micro-batches' loss sums and the gradient norm, on the device."""
        cfg, plan, engine, b = self.cfg, self.plan, self.engine, self.cfg.batch_size
        losses = []
        for micro in range(plan.micro_steps):
            x, y = self.tokens[:, micro * b : (micro + 1) * b]
            engine.start_micro_step(micro, plan.micro_steps)
            with self.autocast():
                loss_sum = self.model(x, y)
            if self.fault and micro == 0:
                self.fault.mid_step(self.comm.step)
            engine.backward(loss_sum / plan.total_tokens)
            losses.append(loss_sum.detach())
        engine.finish_reduction()
        norm = engine.grad_norm()  # on the device: nothing in the step waits for the GPU
        self.opt.update(grad_scale=clip_scale(norm, cfg.grad_clip))
        engine.gather_params()
        return losses, norm

    @torch.no_grad()
    def validate(self) -> float:
        """Mean loss over val_steps global batches of validation sequences, split over the ranks."""
        cfg, b = self.cfg, self.cfg.batch_size
        total = cfg.val_steps * self.plan.seqs_per_step
        per_rank = total // self.dp
        first = self.engine.rank * per_rank
        sums = []
        self.model.eval()
        with self.engine.gathered():
            for s in range(first, first + per_rank, b):
                x, y = self.val_loader.val_batch(s, min(b, first + per_rank - s))
                with self.autocast():
                    sums.append(self.model(x.to(self.device), y.to(self.device)).float())
        self.model.train()
        return gather_loss(self.comm, self.engine, sums) / (total * cfg.seq_len)

    def save(self, step: int) -> float:
        info = {"config": self.cfg.to_toml(), "model": dataclasses.asdict(self.mcfg), "tokenizer": self.tok_name}
        return checkpoint.save(self.ckpt_dir, step, self.engine, self.opt, info, self.shapes, self.rt, self.cfg.keep_ckpts,
                               midway=self.fault.mid_save if self.fault else None)

    def run(self) -> dict:
        try:
            summary = self._run()
        except Exception as e:  # the flight log says where this rank was; then the error goes on
            self.guard.dump(crash_reason(e))
            raise
        # Past the last collective: peers may stop watching us (and we them), so that ranks that
        # finish at different times -- or rank 0 taking the store down with it -- are no alarm.
        self.comm.sync("barrier", "world", self.rt.barrier)
        self.guard.close(clean=True)
        return summary

    def _run(self) -> dict:
        cfg, rt = self.cfg, self.rt
        log = MetricsLog(self.out / "metrics.jsonl", self.start_step) if rt.is_main else None
        rt.log(f"braidtrain: {self.mcfg.num_params() / 1e6:.2f}M parameters, world {rt.world_size} ({rt.backend} on {self.device.type}), "
               f"-d {self.plan.total_tokens} = {self.plan.micro_steps} micro-steps x b {cfg.batch_size} x t {cfg.seq_len} x dp {self.dp}, "
               f"ZeRO-{cfg.zero}{', exact' if cfg.exact else ''} -> {self.out}")
        bar = Progress(cfg.progress and rt.is_main, self.start_step, cfg.max_steps)
        rec, val = None, None
        try:
            with gc_by_hand():
                for step in range(self.start_step, cfg.max_steps):
                    rec = self.step(step)
                    if step == self.start_step and self.load_s is not None:
                        rec["load_s"] = self.load_s
                    last = step + 1 == cfg.max_steps
                    if cfg.val_every and ((step + 1) % cfg.val_every == 0 or last):
                        val = rec["val_loss"] = self.validate()
                    if cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0 and not last:
                        rec["save_s"] = self.save(step + 1)
                    if log:
                        log.write(rec)
                    bar.update(rec)
        finally:
            bar.close()
            if log:
                log.close()
        self.drop_graph()
        if val is None or rec is None:
            val = self.validate()
        save_s = self.save(cfg.max_steps)
        with self.engine.gathered():
            sha = checkpoint.weights_sha256(self.model)
        summary = {"step": cfg.max_steps, "loss": rec["loss"] if rec else None, "val_loss": val,
                   "tokens_per_s": rec["tokens_per_s"] if rec else None, "weights_sha256": sha, "save_s": save_s}
        if cfg.compile:  # how many graphs torch.compile made (one per block shape: 1 for GPT-2)
            from torch._dynamo.utils import counters

            summary["compiled_graphs"] = counters["stats"]["unique_graphs"]
        if rt.is_main:
            summary["unigram_val_loss"] = unigram_entropy(self.train_data)
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
            if rec:
                plot_runs([str(self.out)], str(self.out / "loss.png"))
            rt.log(f"val loss {val:.4f} (unigram baseline of the corpus: {summary['unigram_val_loss']:.4f})")
        if cfg.sample_tokens:  # every rank takes part: under ZeRO-3 gathering is collective
            tok = get_tokenizer(self.tok_name)
            with self.engine.gathered():
                text = tok.decode(generate(self.model, [tok.eot], cfg.sample_tokens, seed=cfg.seed, autocast=self.autocast))
            rt.log("--- sample ---\n" + text + "\n--------------")
        return summary


@torch.no_grad()
def generate(model, prompt: list[int], n: int, *, temperature: float = 0.8, top_k: int = 40, seed: int = 0,
             autocast=nullcontext) -> list[int]:
    """Sample n tokens after the prompt (top-k, temperature), cropping to the model's context."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    # sequence parallelism needs a length divisible by tp: pad on the right, which (causal
    # attention) leaves the logits of the real positions unchanged
    mult = model.tp if getattr(model, "sp", False) else 1
    for _ in range(n):
        ctx = idx[:, -(model.cfg.block_size // mult * mult) :]
        pad = -ctx.shape[1] % mult
        with autocast():
            logits = model(F.pad(ctx, (0, pad)))[:, ctx.shape[1] - 1, :].float() / temperature
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits[logits < kth] = -float("inf")
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
        idx = torch.cat([idx, nxt], dim=1)
    model.train(was_training)
    return idx[0, len(prompt) :].tolist()


def train(cfg: Config) -> dict:
    trainer = Trainer(cfg)
    try:
        return trainer.run()
    finally:
        trainer.drop_graph(wait=False)  # these two are no-ops after a clean finish
        trainer.guard.close(clean=False)
        trainer.rt.close()
