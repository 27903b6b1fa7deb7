"""The training loop: build.py sets the run up, a schedule drives the engine, then steps.

One step, on every rank:

    the schedule's actions for this stage (parallel/schedule.py; today F0 B0 F1 B1 ...):
        forward of a micro-batch (a contiguous block of the step's global sequences) -> the sum of
        its token losses; backward of it divided by the *global* token count (on the last
        backward, each bucket's reduction starts as soon as its gradients are in)
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
on every rank: a full collection among torch.compile's objects takes a noticeable fraction of a
second, and one that struck a single rank inside a step would hold its peers in the next collective.

Around the loop, fault.Guard watches the peers (heartbeat) and writes this rank's flight log when
the rank crashes, is signalled, or loses a peer; a group that torchrun restarts resumes by itself
from the newest checkpoint (docs/fault-tolerance.md). SIGTERM or SIGINT stops the run at the next
step boundary, which every rank reads alike (stop_asked), with a checkpoint of that step (outcome.stop).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import resource
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from braidtrain import evaluate, outcome
from braidtrain.build import build
from braidtrain.config import Config
from braidtrain.errors import SaveFailed, Stopped, UserError
from braidtrain.io import checkpoint
from braidtrain.io.metrics import MetricsLog, Progress, finite, peak_flops
from braidtrain.io.trackers import Trackers
from braidtrain.model.stage import attention_kernel
from braidtrain.optim import clip_scale, lr_at
from braidtrain.parallel import expert
from braidtrain.passes import Passes, reduce_loss

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


class Trainer:
    def __init__(self, cfg: Config, built=None):
        self.mc = evaluate.read_evalfile(cfg.eval_data) if cfg.eval_data else None  # (a bad file fails first)
        run = self.built = built or build(cfg)  # (built: a live recovery's joiner, live/join.py)
        cfg = run.cfg  # as resolved for this run (build)
        self.cfg, self.rt, self.layout, self.mesh, self.comm = cfg, run.rt, run.layout, run.mesh, run.comm
        self.mcfg, self.parts, self.engine, self.opt, self.guard = run.mcfg, run.parts, run.engine, run.opt, run.guard
        self.device, self.bf16, self.fault, self.out = run.rt.device, run.bf16, run.fault, run.out
        self.start_step, self.load_s = run.start_step, run.load_s
        self.batch = self.layout.batch
        # x, y
        self.tokens = torch.zeros((2, self.batch.seqs_per_rank, cfg.seq_len), dtype=torch.long, device=self.device)
        self.passes = Passes(run, self.autocast, self.tokens)
        self.next_tokens = None, None  # (step, its host_tokens), read ahead
        self.shared_checked = False  # the checkpoint folder seen by every rank (check_shared, at the first save)
        self.stop_flag = torch.zeros((), device=self.device)  # (stop_asked's all-reduce)
        self.stop_sig = 0  # the signal that asked the group to stop, as read at the last step boundary
        self.save_est = 0.0  # the longest save of this process (s): whether one fits in a stop's budget
        # --cuda-graph: the captured step, its outputs and collectives
        self.graph = self.graph_out = self.graph_handles = None
        self.balance = run.balance  # --moe-balance bias: every MoE layer's expert biases (n_layer, E), all ranks alike
        try:
            self.trackers = self.open_trackers()
        except BaseException:
            run.guard.close(clean=False)
            raise

    def open_trackers(self):
        """TensorBoard and W&B on rank 0 (trackers.py), or None; collective: a tracker that cannot
        start (W&B without a login) is the same one-line error on every rank."""
        if not (self.cfg.tensorboard or self.cfg.wandb):
            return None
        trackers, err = None, None
        if self.rt.is_main:
            try:
                trackers = Trackers(self.cfg, self.out, self.start_step)
            except UserError as e:
                err = str(e)
        err = self.comm.broadcast_object(err, self.mesh.groups["world"])
        if err:
            raise UserError(err)
        return trackers

    def autocast(self):
        # no weight-cast cache: each block uses its weights once per forward, and a cache would
        # outlive a captured graph's region (--cuda-graph)
        if self.bf16:
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, cache_enabled=False)
        return nullcontext()

    # -- one optimizer step ---------------------------------------------------------------------
    def step(self, step: int) -> dict:
        cfg, batch, engine = self.cfg, self.batch, self.engine
        t0 = time.time()
        self.comm.begin_step(step + 1)  # stamped on this step's flight records
        self.guard.doing = f"in step {step + 1}"
        # this rank's sequences of the step, read while the previous step ran on the GPU, copied
        # once and asynchronously
        nxt, xy = self.next_tokens
        self.tokens.copy_(xy if nxt == step else self.host_tokens(step), non_blocking=True)
        lr = lr_at(step, lr=cfg.lr, warmup=cfg.warmup_steps, max_steps=cfg.max_steps, final_frac=cfg.final_lr_frac)
        self.opt.prepare(lr)
        if self.fault and self.opt.offload is not None:  # (the test hook: collective/inject.py)
            self.opt.offload.hold = self.fault.holds_offload(step + 1)
        if cfg.cuda_graph and self.graph is None and step >= self.start_step + GRAPH_WARMUP:
            # the warm-up steps compiled the blocks and set every lazy state; the capture records
            # the step's kernels without running them, each replay runs them
            self.graph = torch.cuda.CUDAGraph()
            with self.comm.capture() as self.graph_handles, torch.cuda.graph(self.graph):
                self.graph_out = self.work()
        if self.graph is not None:
            self.graph.replay()
            self.comm.replayed(self.graph_handles, self.mesh.groups["world"])
            losses, norm, skip = self.graph_out
        else:
            losses, norm, skip = self.work()
        host_s = time.time() - t0  # the step's work issued; nothing has waited for the GPU yet
        if step + 1 < cfg.max_steps:  # while the GPU works: the next step's tokens
            self.next_tokens = step + 1, self.host_tokens(step + 1)
        self.collect_garbage(step)
        loss = self.reduce_loss(losses) / batch.total_tokens
        dt = time.time() - t0
        tps = batch.total_tokens / dt
        peak = peak_flops(self.device, self.bf16)
        mfu = self.mcfg.flops_per_token(cfg.seq_len) * tps / (peak * self.rt.world_size) if peak else None
        if self.device.type == "cuda":
            mem = torch.cuda.max_memory_allocated(self.device) / 1e9
        else:
            mem = self.state_bytes() / 1e9
        comm_s, bus_bytes = self.comm.step_comm()
        norm, skipped = norm.item(), skip.item() > 0
        if skipped:  # the update was skipped (work()); Adam's step count does not count it
            self.opt.step_count -= 1
        rec = {"step": step + 1, "loss": finite(loss), "lr": lr, "grad_norm": finite(norm),
               "tokens_per_s": tps, "mfu": mfu, "mem_gb": mem, "step_s": dt, "host_s": host_s, "comm_s": comm_s,
               "comm_busbw_GBps": bus_bytes / comm_s / 1e9 if bus_bytes and comm_s > 0 else None,
               "exposed_comm_s": engine.exposed_comm_s()}
        if skipped:
            rec["skipped"] = True
            bad_loss = not math.isfinite(loss)
            rec["skip_reason"] = f"{'loss' if bad_loss else 'gradient norm'} is {loss if bad_loss else norm}"
        if self.opt.offload is not None:  # how long this step waited for the host's update (parallel/offload.py)
            rec["offload_s"], rec["offload_update_s"] = self.opt.offload.figures()
            # as mem_gb: on a GPU the peak resident (KiB), on the CPU the offloaded state (plan --check's)
            rec["host_gb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if self.device.type == "cuda"
                              else self.opt.offload.host_bytes()) / 1e9
        if self.layout.pp > 1:
            rec["bubble"] = self.passes.bubbles()
        if self.mcfg.moe_experts:
            rec.update(self.moe_metrics(skipped))
        self.stop_sig = self.stop_asked()
        return rec

    def stop_asked(self) -> int:
        """At a step boundary, on every rank: the signal that asked any rank to stop (0: none) --
        one small all-reduce of each rank's note (fault.Guard.signalled), so that every rank reads
        the same answer after the same step, whenever the signals came."""
        self.stop_flag.fill_(self.guard.signalled[0] if self.guard.signalled else 0)
        self.comm.all_reduce(self.stop_flag, self.mesh.groups["world"], op=dist.ReduceOp.MAX).wait()
        return int(self.stop_flag.item())

    def reduce_loss(self, losses: list[torch.Tensor]) -> float:
        """The step's loss sum over every rank (passes.reduce_loss)."""
        return reduce_loss(self.comm, self.mesh, losses)

    def moe_metrics(self, skipped: bool) -> dict:
        """This step's mixture-of-experts figures (parallel/expert.py step_figures); with
        --moe-balance bias the experts' biases moved by the step's loads (not a skipped step's)."""
        return expert.step_figures(self.parts, self.comm, self.mesh.groups["world"], self.mcfg, self.balance,
                                   move=not skipped)

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
        collections scan only what was made since (docs/performance-history.md has the figures)."""
        if step == self.start_step:
            gc.collect()
            gc.freeze()
        elif (step - self.start_step) % GC_EVERY == 0:
            gc.collect()

    def host_tokens(self, step: int) -> torch.Tensor:
        """(2, sequences, T): this rank's inputs and targets of a step -- its data rank's, the dp
        coordinate: the ranks of one replica read the same sequences -- in pinned memory on GPU
        runs (a copy from pageable memory would make the host wait for the GPU)."""
        rows = self.batch.seqs_per_rank
        xy = torch.stack(self.built.loader.batch(step, self.mesh.coord("dp") * rows, rows))
        return xy.pin_memory() if self.device.type == "cuda" else xy

    def work(self) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """The step's device work, from the tokens in self.tokens to updated parameters: the
        same kernels with the same arguments every step (what --cuda-graph captures). Returns
        the micro-batches' loss sums, the gradient norm and whether the update was skipped, on
        the device."""
        engine = self.engine
        losses = self.passes.train_step()
        engine.finish_step()
        self.reduced()
        norm = engine.grad_norm()  # on the device: nothing in the step waits for the GPU
        # A step whose loss on any rank, or whose (global) gradient norm, is not finite changes no
        # weight on any rank: decided together -- the loss's verdict summed over the world, the
        # norm the same everywhere -- so the replicas never part, and nothing waits to know.
        bad = torch.zeros((), device=self.device)
        for s in losses:
            bad += (~torch.isfinite(s)).float()
        self.comm.all_reduce(bad, self.mesh.groups["world"]).wait()
        skip = ((bad > 0) | ~torch.isfinite(norm)).float()
        self.update(clip_scale(norm, self.cfg.grad_clip), skip)
        engine.gather_params()
        return losses, norm, skip

    def reduced(self) -> None:
        """The step's gradients are reduced (live recovery's buddy copies take theirs here: live/)."""

    def update(self, grad_scale, skip) -> None:
        self.opt.update(grad_scale=grad_scale, skip=skip)

    def state_bytes(self) -> int:
        """Bytes of weights, gradients and optimizer state this rank holds (a CPU run's mem_gb)."""
        return self.engine.model_state_bytes() + 2 * 4 * self.opt.state_numel()

    def check_shared(self, ckpt_dir) -> None:
        """At the first save: every rank leaves a marker in the checkpoint folder, and rank 0 says
        in one line if it does not see them all -- the folder is not one folder for every rank
        (node-local disks), so no checkpoint would be whole and a restart would start over."""
        marks = ckpt_dir.parent / ".ranks"  # (beside the checkpoints, in the run directory)
        if self.fault and self.fault.kind == "local-disk":  # (the test hook: this rank's "disk" is its own)
            marks = ckpt_dir.parent / f".rank{self.rt.rank}-local" / ".ranks"
        marks.mkdir(parents=True, exist_ok=True)
        (marks / str(self.rt.rank)).touch()
        self.comm.barrier(self.mesh.groups["world"])
        if self.rt.is_main:
            seen = {int(p.name) for p in (ckpt_dir.parent / ".ranks").iterdir() if p.name.isdigit()}
            missing = sorted(set(range(self.rt.world_size)) - seen)
            if missing:
                self.rt.log(f"warning: rank 0 does not see the checkpoint files of rank(s) {_ranges(missing)} in "
                            f"{ckpt_dir}: it is not one folder shared by every rank (node-local disks?), so no "
                            f"checkpoint will be whole and a restart would begin at step 0; give --out a folder on "
                            f"storage every node mounts")

    def save(self, step: int, final: bool = False) -> float | None:
        """A checkpoint of step `step`, unless a weight or an Adam moment is not finite on some
        rank (collective): then none, and the newest good one stays the newest. None too under
        --no-save. A save that fails stops the run (SaveFailed) when it is the `final` one, whatever
        --on-save-error says: the run's last steps would be lost without a word."""
        if not self.cfg.save:
            return None
        self.guard.doing = f"while saving step {step}"
        self.opt.wait()  # (--offload: the step's update may still be landing)
        bad = torch.zeros((), device=self.device)
        for b, (m, v, _) in zip(self.engine.buckets, self.opt.groups):
            n = (~torch.isfinite(b.master)).sum() + (~torch.isfinite(m)).sum() + (~torch.isfinite(v)).sum()
            bad += n.to(bad.device)  # (a fp32 master: --offload's on the host)
        self.comm.all_reduce(bad, self.mesh.groups["world"]).wait()
        if bad.item():
            self.rt.log(f"step {step}: checkpoint not saved: {int(bad.item())} weights or optimizer moments are not "
                        f"finite (the newest good checkpoint stays)")
            return None
        if not self.shared_checked:
            self.shared_checked = True
            self.check_shared(self.out / "checkpoints")
        info = {"config": self.cfg.to_toml(), "family": self.mcfg.family, "model": dataclasses.asdict(self.mcfg),
                "tokenizer": self.built.tok_name}
        if self.mcfg.moe_balance == "bias":
            info["moe_bias"] = self.balance.tolist()
        try:
            midway = self.fault.mid_save if self.fault else None
            secs = checkpoint.save(self.out / "checkpoints", step, self.engine, self.opt, info, self.rt, self.layout,
                                   self.cfg.keep_ckpts, self.built.run_id, midway=midway)
            self.save_est = max(self.save_est, secs)
            return secs
        except SaveFailed as e:
            if final and self.cfg.on_save_error == "continue":
                raise SaveFailed(f"{e}; the run's final checkpoint, so the run fails whatever --on-save-error "
                                 f"says") from None
            if self.cfg.on_save_error == "stop":
                raise
            self.rt.log(f"warning: {e}; training goes on (--on-save-error continue), the next save tries again")
            return None

    def run(self) -> dict:
        try:
            summary = self._run()
        except Stopped:  # (outcome.stop: every rank stops here, its flight log written; as below, then)
            self.comm.barrier(self.mesh.groups["world"])
            self.guard.close(clean=True)
            raise
        except Exception as e:  # the flight log says where this rank was; then the error goes on
            self.guard.dump(self.guard.failure(e))
            if isinstance(e, torch.OutOfMemoryError):
                raise UserError(outcome.out_of_memory(self)) from None
            raise
        self.end()
        return summary

    def end(self) -> None:
        """Past the last collective: peers may stop watching us (and we them), so that ranks that
        finish at different times -- or rank 0 taking the store down with it -- are no alarm."""
        self.comm.barrier(self.mesh.groups["world"])
        self.guard.close(clean=True)

    def _run(self) -> dict:
        cfg, rt, batch = self.cfg, self.rt, self.batch
        log = MetricsLog(self.out / "metrics.jsonl", self.start_step, rt.log) if rt.is_main else None
        rt.log(f"braidtrain: {self.mcfg.num_params() / 1e6:.2f}M parameters, world {rt.world_size} ({rt.backend} on "
               f"{self.device.type}), {self.layout.describe()}, -d {batch.total_tokens} = {batch.micro_steps} "
               f"micro-steps x b {cfg.batch_size} x t {cfg.seq_len} x dp {self.layout.dp}, "
               f"attention {attention_kernel(self.parts, self.layout.cp)} -> {self.out}")
        bar = Progress(cfg.progress and rt.is_main, self.start_step, cfg.max_steps)
        rec, val, bubbles, ev = None, None, [], None
        eval_every = cfg.val_every if cfg.eval_every is None else cfg.eval_every
        skipped, streak = 0, []
        failed, done = True, self.start_step
        try:
            with gc_by_hand():
                for step in range(self.start_step, cfg.max_steps):
                    rec = self.step(step)
                    skipped += rec.get("skipped", False)
                    streak = streak + [rec] if rec.get("skipped") else []
                    bubbles += [rec["bubble"]] if "bubble" in rec else []
                    if step == self.start_step and self.load_s is not None:
                        rec["load_s"] = self.load_s
                    last = step + 1 == cfg.max_steps
                    if cfg.val_every and ((step + 1) % cfg.val_every == 0 or last):
                        val = rec["val_loss"] = self.passes.validate(self.device)
                    if self.mc and ((eval_every and (step + 1) % eval_every == 0) or last):
                        ev = evaluate.in_training(self)
                        rec.update(ev)
                    # (a stop asked: stop() saves this step, if the budget left allows)
                    if cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0 and not last and not streak \
                            and not self.stop_sig:
                        rec["save_s"] = self.save(step + 1)
                    if log:
                        log.write(rec)
                    if self.trackers:  # the same record, in TensorBoard and W&B
                        self.trackers.write(rec)
                    bar.update(rec)
                    if len(streak) >= cfg.max_skipped:
                        raise outcome.diverged(self, streak)
                    done = step + 1
                    if self.stop_sig:  # (read by every rank at the end of the step: self.step)
                        break
            failed = False
        finally:
            bar.close()
            if log:
                log.close()
            if self.trackers:
                self.trackers.close(failed)
        self.drop_graph()
        if self.stop_sig:
            outcome.stop(self, self.stop_sig, done, saved=rec.get("save_s") is not None)
        return self.finish(rec, val, ev, skipped, bubbles)

    def finish(self, rec, val, ev, skipped: int, bubbles: list) -> dict:
        """After the last step: the final save, validation and summary (outcome.finish)."""
        return outcome.finish(self, rec, val, ev, skipped, bubbles)

    def past_collectives(self) -> None:
        """(outcome.finish, on every rank, once the run's last collective is done.) A hook: live
        recovery's rank 0 marks the run complete there (live/trainer.py)."""


def _ranges(ranks: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        start = r if start is None else start
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}-{r}" if r > start else str(r))
            start = None
    return ", ".join(out)
