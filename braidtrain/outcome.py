"""How a run ends: the summary and the sample after its last step, the one-line errors of a
run that ran out of device memory or whose loss diverged, and the stop a signal asked for
(preemption: a checkpoint of the last step within the budget). (The Trainer's loop is train.py.)"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from braidtrain import evaluate
from braidtrain.errors import Diverged, Stopped
from braidtrain.generate import generate, sample_prompt
from braidtrain.io import checkpoint
from braidtrain.io.data import get_tokenizer, unigram_entropy
from braidtrain.io.metrics import plot_runs
from braidtrain.model.stage import attention_kernel
from braidtrain.plan.search import advice
from braidtrain.plan.space import Setup, candidate_of


def finish(tr, rec: dict | None, val, ev: dict | None, skipped: int, bubbles: list) -> dict:
    """After the last step (trainer `tr`, the last step's record `rec`, the last validation loss
    `val` and evaluation `ev`): the final checkpoint, validation and evaluation if the loop did
    none, summary.json and loss.png (rank 0), and the sample. Returns the summary."""
    cfg, rt = tr.cfg, tr.rt
    save_s = tr.save(cfg.max_steps, final=True)  # first: a stop by signal from here on loses no step
    sig = tr.stop_asked()
    if sig:  # (--resume auto then validates and writes the summary)
        stop(tr, sig, cfg.max_steps, saved=save_s is not None)
    if val is None or rec is None:
        val = tr.passes.validate(tr.device)
    if tr.mc and ev is None:  # (a run resumed at its last step)
        ev = evaluate.in_training(tr)
    sha = checkpoint.weights_sha256(tr.engine)
    summary = {"step": cfg.max_steps, "loss": rec["loss"] if rec else None, "val_loss": val,
               "skipped_steps": skipped, "tokens_per_s": rec["tokens_per_s"] if rec else None,
               "weights_sha256": sha, "save_s": save_s, "attention": attention_kernel(tr.parts, tr.layout.cp),
               **(ev or {})}
    if tr.layout.pp > 1:  # each stage's mean bubble over the run's steps
        summary["bubble"] = [sum(b) / len(b) for b in zip(*bubbles)] if bubbles else None
        tr.passes.write_schedule(tr.out / "schedule.json", rec["bubble"] if rec else None)
    if cfg.compile:  # how many graphs torch.compile made (one per block shape: 1 for GPT-2)
        from torch._dynamo.utils import counters

        summary["compiled_graphs"] = counters["stats"]["unique_graphs"]
    sample = None
    if cfg.sample_tokens:  # every rank takes part: under ZeRO-3 gathering is collective
        tok = get_tokenizer(tr.built.tok_name)
        prompt = sample_prompt(tok, tr.built.val_loader.data)  # e.g. a speaker's name line
        context = min(tr.mcfg.block_size, cfg.seq_len)  # the positions it was trained on
        with tr.engine.gathered():
            text = tok.decode(generate(tr.passes.next_logits, prompt or [tok.eot], cfg.sample_tokens,
                                       block_size=context, device=tr.device,
                                       mult=tr.layout.tp if tr.layout.sp else 1, seed=cfg.seed,
                                       share=tr.passes.share_token))
        start = f"the prompt {tok.decode(prompt)!r}, from the validation text" if prompt else "no prompt"
        sample = (f"--- sample ---\n[{start}, then {cfg.sample_tokens} sampled tokens]\n" + tok.decode(prompt) + text
                  + "\n--------------")
    tr.past_collectives()  # (the run's last collective is done: what is left is this rank's own)
    if rt.is_main:
        summary["unigram_val_loss"] = unigram_entropy(tr.built.train_data)
        (tr.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        if rec:
            plot_runs([str(tr.out)], str(tr.out / "loss.png"))
        rt.log(f"val loss {val:.4f} (unigram baseline of the corpus: {summary['unigram_val_loss']:.4f})")
        if sample:
            rt.log(sample)
    return summary


def out_of_memory(tr) -> str:
    """The one line for a step that ran out of device memory: the planner's view of it."""
    lay, cfg = tr.layout, tr.cfg
    if tr.device.type == "cuda":
        mem = torch.cuda.get_device_properties(tr.device).total_memory / 1e9
    else:  # (a CPU run: this process's share of the machine)
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 / tr.rt.world_size
    s = Setup(tr.mcfg, lay.world, mem, cfg.seq_len, lay.batch.total_tokens, bucket_mb=cfg.bucket_mb,
              cpu=tr.device.type == "cpu", fp8=lay.fp8, compile=cfg.compile, live=cfg.live_recovery)
    return (f"out of memory on {tr.device} (rank {tr.rt.rank}) at step {tr.comm.step}: "
            f"{advice(s, candidate_of(lay))}; `braidtrain plan` lists the layouts that fit")


def diverged(tr, streak: list[dict]) -> Diverged:
    """The one line that ends a run whose last --max-skipped steps were all skipped."""
    good = checkpoint.list_checkpoints(tr.out / "checkpoints")
    where = "no checkpoint was saved"
    if good:
        where = f"the last good checkpoint is {good[-1]} (--resume auto starts there)"
    return Diverged(f"steps {streak[0]['step']}-{streak[-1]['step']} were skipped, {len(streak)} in a row "
                    f"({streak[-1]['skip_reason']}; none was applied): stopped at step {streak[-1]['step']}; "
                    f"{where}; try a lower --lr (now {tr.cfg.lr:g}) or --grad-clip 1.0 (now "
                    f"{tr.cfg.grad_clip:g})")


def stop(tr, signum: int, done: int, saved: bool) -> None:
    """Trainer `tr`, every rank, at the step boundary where the group read a stop request: a
    checkpoint of step `done`, the last completed one -- unless that step's is `saved` already, or the last
    save took longer than the budget the group has left -- then the flight log, one line (rank
    0) and Stopped: exit 128 + signal."""
    name = signal.Signals(signum).name
    t = torch.tensor([tr.save_est, -tr.guard.left()], dtype=torch.float64, device=tr.device)
    tr.comm.all_reduce(t, tr.mesh.groups["world"], op=dist.ReduceOp.MAX).wait()  # (the same on every rank)
    est, left = t[0].item(), -t[1].item()
    tr.guard.stop_within(left, signum)
    newest = checkpoint.list_checkpoints(tr.out / "checkpoints")
    newest = f"the newest checkpoint is {newest[-1]}" if newest else "there is no checkpoint"
    if saved:
        what = f"its checkpoint was saved at that step; {newest}"
    elif done == tr.start_step:
        what = f"no step was completed, nothing to save; {newest}"
    elif not tr.cfg.save:
        what = "nothing saved (--no-save)"
    elif est > left:
        what = (f"not saved: the last save took {est:.1f} s and {left:.1f} s of --preempt-budget "
                f"{tr.cfg.preempt_budget:g} s were left; {newest}")
    else:
        secs = tr.save(done, final=True)
        what = (f"saved {tr.out / 'checkpoints' / f'step_{done:08d}'} in {secs:.1f} s" if secs is not None
                else f"not saved (weights not finite); {newest}")
    where = tr.guard.dump(f"signal {name}")
    if tr.rt.is_main:
        print(f"braidtrain: rank 0: signal {name}; flight log {where}; stopped after step {done} of "
              f"{tr.cfg.max_steps}: {what}; continue with --resume auto (exit {128 + signum})",
              file=sys.stderr, flush=True)
    raise Stopped(signum)
