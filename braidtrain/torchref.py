"""The yardstick of `braidtrain bench train`: the same model, data and optimizer through plain torch.

    python -m torch.distributed.run --nproc-per-node N -m braidtrain.torchref \
        --mode ddp|ddp-compile|fsdp2 --model gpt2 -i DATA -b 16 -t 1024 -d 131072 --steps 20 --json OUT

The model is braidtrain's GPT with tp = 1 (torch's own modules, SDPA attention), initialised with
the same seed, its logits going into torch's cross-entropy inside the module (not loss.py's
fused head); each rank reads the same global sequences braidtrain's loader gives it; the loss is
the token sum over the global token count, as in braidtrain. The optimizer is torch's fused AdamW
(weight decay on 2-D weights) with braidtrain's schedule and defaults, gradient clipping at 1.0, bf16 on GPU: autocast under DDP, FSDP2's
MixedPrecisionPolicy (bf16 parameters, fp32 reduction) under FSDP2, fp32 on CPU. Gradient
accumulation skips the synchronisation of all but the last micro-step (DDP's no_sync, FSDP2's
set_requires_gradient_sync). ddp-compile is nanoGPT's recipe: torch.compile the model, then DDP.

Writes {"mode", "world_size", "step_s": [...], "loss": [...], "mem_gb", "tokens_per_step",
"flops_per_token", "peak_flops"} from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from braidtrain.config import Config
from braidtrain.layout import batch_plan
from braidtrain.data import Loader, TokenData, data_tokenizer, resolve_files
from braidtrain.metrics import peak_flops
from braidtrain.model.gpt import GPT, init_weights, model_config
from braidtrain.optim import lr_at

MODES = ("ddp", "ddp-compile", "fsdp2")


class TorchLoss(torch.nn.Module):
    """braidtrain's GPT with torch's own head and cross-entropy (not loss.py's fused kernel), inside
    the module, so that torch.compile fuses the loss as it would in anyone's torch script."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, x, y):
        logits = self.gpt(x)  # (B, T, vocab): the real vocabulary
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum")


def build(mode, model, device, bf16):
    """The wrapped model and what its micro-steps need: (model, sync_context(last), autocast)."""
    rank = dist.get_rank()
    if mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
        for block in model.gpt.h:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)

        def sync(last):
            model.set_requires_gradient_sync(last)
            return nullcontext()

        return model, sync, nullcontext
    from torch.nn.parallel import DistributedDataParallel as DDP

    if mode == "ddp-compile":
        model = torch.compile(model)
    ids = [device.index if device.index is not None else rank] if device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else nullcontext
    return ddp, (lambda last: nullcontext() if last else ddp.no_sync()), autocast


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="braidtrain.torchref")
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--model", default="gpt2")
    for k in ("--n-layer", "--n-head", "--n-embd"):
        p.add_argument(k, type=int)
    p.add_argument("-i", "--train-data", required=True)
    p.add_argument("-b", type=int, default=16)
    p.add_argument("-t", type=int, default=1024)
    p.add_argument("-d", type=int)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", required=True)
    p.add_argument("--device")
    a = p.parse_args(argv)

    dist.init_process_group("nccl" if torch.cuda.is_available() and a.device != "cpu" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.device == "cpu" or not torch.cuda.is_available():
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    bf16 = device.type == "cuda"
    cfg = Config(model=a.model, train_data=a.train_data, batch_size=a.b, seq_len=a.t, total_batch=a.d)
    plan = batch_plan(cfg.total_batch, cfg.batch_size, cfg.seq_len, world)
    files = resolve_files(a.train_data, "train")
    data = TokenData(files, data_tokenizer(files)[1])
    mcfg = model_config(a.model, data.vocab_size, a.n_layer, a.n_head, a.n_embd)
    loader = Loader(data, a.t, plan.seqs_per_step, cfg.seed)

    model = GPT(mcfg)
    init_weights(model, cfg.seed)
    model.to(device)
    model = TorchLoss(model)
    net, sync, autocast = build(a.mode, model, device, bf16)  # FSDP2 replaces the parameters
    decay = [q for q in model.parameters() if q.dim() >= 2]
    rest = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    step_s, losses = [], []
    first = rank * plan.seqs_per_rank
    for step in range(a.steps):
        t0 = time.time()
        total = torch.zeros((), device=device)
        for micro in range(plan.micro_steps):
            x, y = loader.batch(step, first + micro * a.b, a.b)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with sync(micro == plan.micro_steps - 1), autocast():
                loss = net(x, y)
                (loss / plan.total_tokens).backward()
            total += loss.detach().float()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=cfg.lr, warmup=cfg.warmup_steps, max_steps=a.steps, final_frac=cfg.final_lr_frac)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(total.item() / plan.total_tokens)  # the host waits here: the step is done
        step_s.append(time.time() - t0)
    if rank == 0:
        mem = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
        peak = peak_flops(device, bf16)
        with open(a.json, "w") as f:
            json.dump({"mode": a.mode, "world_size": world, "step_s": step_s, "loss": losses, "mem_gb": mem,
                       "tokens_per_step": plan.total_tokens, "flops_per_token": mcfg.flops_per_token(a.t),
                       "peak_flops": peak and peak * world}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown after collectives: see braidtrain.cli.run
