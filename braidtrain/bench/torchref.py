"""The yardstick of `braidtrain bench train`: the same model, data and optimizer through plain torch.

    python -m torch.distributed.run --nproc-per-node N -m braidtrain.bench.torchref \
        --mode ddp|ddp-compile|fsdp2|hf|... --model gpt2 -i DATA -b 16 -t 1024 -d 131072 --steps 20 --json OUT
    python -m braidtrain.bench.torchref --mode hf ...     # one process: no torchrun needed

The model is braidtrain's GPT with tp = 1 (torch's own modules, SDPA attention), initialised with
the same seed, its logits going into torch's cross-entropy inside the module (not loss.py's
fused head); each rank reads the same global sequences braidtrain's loader gives it; the loss is
the token sum over the global token count, as in braidtrain. The optimizer is torch's fused AdamW
(weight decay on 2-D weights) with braidtrain's schedule and defaults, gradient clipping at 1.0,
bf16 on GPU: autocast under DDP, FSDP2's MixedPrecisionPolicy (bf16 parameters, fp32 reduction)
under FSDP2, fp32 on CPU. Gradient accumulation skips the synchronisation of all but the last
micro-step (DDP's no_sync, FSDP2's set_requires_gradient_sync). DDP and FSDP2 average the ranks'
gradients, so each rank divides its loss sum by its own token count: the gradient, its norm and the
clipping are braidtrain's.
What each compiles and fuses: ddp and fsdp2 nothing (eager; torch's fused AdamW, SDPA's flash
attention); ddp-compile is nanoGPT's recipe, torch.compile of the whole model (head and
cross-entropy included), then DDP; fsdp2-compile compiles each block (Module.compile), then
shards it (torchtitan's order), the head and loss eager. braidtrain's own head and loss are
loss.py's fused kernel in every layout; its --compile compiles each block.

hf and hf-compile are someone else's implementation of the model: transformers' class of its
family (LlamaForCausalLM, GPT2LMHeadModel, MixtralForCausalLM, Qwen3MoeForCausalLM; SDPA attention,
a mixture's experts by transformers' default, its grouped GEMM), holding braidtrain's initial
weights (through the family's HuggingFace adapter, as `export --format hf` writes them), trained the
way a user would: fp32 master weights, bf16 autocast on GPU, torch's fused AdamW, eager or
torch.compile of the whole model (head and cross-entropy included); torch DDP only when there is
more than one process. Its logits go into the same cross-entropy sum as the other modes' (a
mixture's without the balance loss, which transformers adds only when asked for router logits:
braidtrain's --moe-aux term, 0.01 of a loss near 1, moves the losses less than --loss-tol).

ao-tensorwise and ao-rowwise are ddp-compile with torchao's float8 training (its recipe of that
name: convert_to_float8_training) on the blocks' linears, those --fp8 computes in float8: the
yardstick of --fp8 (torchao is not a dependency: installed by hand where it is wanted).

pipe-1f1b and pipe-interleaved run torch.distributed.pipelining's Schedule1F1B and
ScheduleInterleaved1F1B (2 chunks a rank) over all ranks (pp = world, dp = 1) on braidtrain's own
stages of the model (model.GPT with a block range; braidtrain's split for that schedule), the loss
the same token sum over the global count (torch's microbatch scaling off); the tied embedding's
two copies get their summed gradient (an all-reduce over the first and last ranks), the
gradient norm counts it once, and each copy takes the same AdamW step.

fsdp2-offload and fsdp2-offload-compile are the same transformers model under torch FSDP2 with
its CPUOffloadPolicy (each decoder layer a unit, compiled first under -compile): the sharded fp32
parameters, their fp32 gradients and so AdamW's moments live in host memory, and torch's fused
AdamW updates them there; each unit's bf16 parameters are copied to the GPU for its forward and
backward (MixedPrecisionPolicy as fsdp2's). It is what a torch user picks for a model whose state
does not fit the GPU, the yardstick of `train --offload optimizer`. deepspeed-offload is DeepSpeed's
ZeRO-Offload (zero_offload) over the same model, where the deepspeed package is installed (it is
no dependency; docs/performance.md says how it travels to the GPU machine).

Writes {"mode", "world_size", "step_s": [...], "loss": [...], "mem_gb", "tokens_per_step",
"flops_per_token", "peak_flops", "host_gb"} from rank 0 (host_gb: its process's peak resident
memory, max RSS).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from braidtrain.bench import titan
from braidtrain.io import export
from braidtrain.config import batch_scaled, build_config
from braidtrain.layout import batch_plan, make_layout
from braidtrain.model.layers import ColumnParallelLinear, RowParallelLinear
from braidtrain.io.data import Loader, TokenData, data_tokenizer, resolve_files
from braidtrain.io.metrics import peak_flops
from braidtrain.model import registry
from braidtrain.parallel.placement import init_weights
from braidtrain.optim import lr_at

MODES = ("ddp", "ddp-compile", "fsdp2", "fsdp2-compile", "hf", "hf-compile", "pipe-1f1b", "pipe-interleaved",
         "ao-tensorwise", "ao-rowwise", "fsdp2-offload", "fsdp2-offload-compile", "deepspeed-offload", *titan.MODES)


class TorchLoss(torch.nn.Module):
    """braidtrain's GPT with torch's own head and cross-entropy (not loss.py's fused kernel), inside
    the module, so that torch.compile fuses the loss as it would in anyone's torch script."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def logits(self, x):
        return self.gpt(x)  # (B, T, vocab): the real vocabulary

    def forward(self, x, y):
        return F.cross_entropy(self.logits(x).flatten(0, 1).float(), y.flatten(), reduction="sum")


class HFLoss(TorchLoss):
    """A transformers model (hf_model) with the same cross-entropy sum."""

    def logits(self, x):
        return self.gpt(input_ids=x).logits


def hf_model(mcfg, seed: int, device):
    """transformers' model of mcfg's architecture (its family's hf_config says which; SDPA) on `device`,
    holding braidtrain's initial weights of seed: our whole model built and initialised on the host
    (tp = 1: every tensor full), handed over through the family's HF adapter -- the tensors and
    config.json that `export --format hf` would write, without the round trip through a folder."""
    import transformers

    fam = registry.family_of(mcfg)
    ours = registry.build(mcfg)
    init_weights(ours, seed)
    tensors = export.to_hf({n: p.detach() for n, p in ours.named_parameters()}, mcfg)
    del ours
    # no KV cache: it is training (the end-of-text id the config names plays no part in it)
    hf = fam.hf_config(mcfg, 0)
    arch = hf["architectures"][0]
    config = transformers.AutoConfig.for_model(**hf, attn_implementation="sdpa", use_cache=False)
    with torch.device(device):  # built where it trains: HF's own initialisation is quick there, and overwritten next
        model = getattr(transformers, arch)(config)
    if mcfg.moe_experts and not set(tensors) <= set(model.state_dict()):  # transformers 5: experts fused in memory
        tensors = fam.fuse(tensors, mcfg)
    got = model.load_state_dict(tensors, strict=False)
    # a tied head is the embedding's own tensor, which the adapter hands over once
    state = model.state_dict(keep_vars=True)
    given = {id(state[n]) for n in tensors if n in state}
    untied = [n for n in got.missing_keys if id(state[n]) not in given]
    if got.unexpected_keys or untied:
        raise RuntimeError(f"{arch} did not take braidtrain's weights: missing {untied[:3]}, "
                           f"unexpected {got.unexpected_keys[:3]}")
    return model


def hf_blocks(hf):
    """A transformers model's decoder layers (Llama, Qwen3, Mixtral: model.layers; GPT-2: transformer.h)."""
    return hf.model.layers if hasattr(hf, "model") else hf.transformer.h


def build(mode, model, device, bf16):
    """The wrapped model and what its micro-steps need: (model, sync_context(last), autocast)."""
    rank = dist.get_rank()
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else nullcontext
    if mode in titan.MODES:  # FSDP2 as torchtitan applies it: bf16 parameters, no autocast; a sync every micro-step
        return model, (lambda last: nullcontext()), nullcontext
    if mode.startswith("hf") and dist.get_world_size() == 1:  # one GPU: no DDP, as a user would run it
        return (torch.compile(model) if mode == "hf-compile" else model), (lambda last: nullcontext()), autocast
    if mode.startswith("fsdp2"):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
        # fsdp2-offload*: the sharded fp32 parameters, their gradients and so AdamW's state on the host
        # (pinned on a GPU; torch refuses pinned memory without an accelerator, so not on the CPU)
        off = CPUOffloadPolicy(pin_memory=device.type == "cuda") if "offload" in mode else OffloadPolicy()
        for block in hf_blocks(model.gpt) if "offload" in mode else model.gpt.blocks():
            if mode.endswith("-compile"):  # each block compiled, then sharded (torchtitan's order)
                block.compile()
            fully_shard(block, mp_policy=mp, offload_policy=off)
        fully_shard(model, mp_policy=mp, offload_policy=off)

        def sync(last):
            model.set_requires_gradient_sync(last)
            return nullcontext()

        return model, sync, nullcontext
    from torch.nn.parallel import DistributedDataParallel as DDP

    if mode.startswith("ao-"):  # torchao's float8 recipe on the linears --fp8 computes in float8
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        linears = {m for block in model.gpt.blocks() for m in block.modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
        convert_to_float8_training(model, module_filter_fn=lambda m, _fqn: m in linears,
                                   config=Float8LinearConfig.from_recipe_name(mode.removeprefix("ao-")))
    if mode in ("ddp-compile", "hf-compile") or mode.startswith("ao-"):
        model = torch.compile(model)
    ids = [device.index if device.index is not None else rank] if device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids)
    return ddp, (lambda last: nullcontext() if last else ddp.no_sync()), autocast


def run_pipe(a, mcfg, loader, plan, cfg, device, bf16):
    """pipe-*: torch's pipeline schedules over braidtrain's stages; returns (step_s, losses)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    interleaved = a.mode == "pipe-interleaved"
    lay = make_layout(world, mcfg, seq_len=a.t, batch_size=a.b, total_batch=a.d, pp=world,
                      schedule="interleaved" if interleaved else "1f1b")
    last = world * lay.virtual - 1
    parts = [registry.build(mcfg, blocks=lay.split[c], first=c == 0, last=c == last, stage=c)
             for c in range(rank, last + 1, world)]
    for part in parts:
        init_weights(part, cfg.seed)
        part.to(device)
    stages = [PipelineStage(part, part.stage, last + 1, device) for part in parts]

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum") / plan.total_tokens

    kw = dict(n_microbatches=plan.micro_steps, loss_fn=loss_fn, scale_grads=False)
    sched = ScheduleInterleaved1F1B(stages, **kw) if interleaved else Schedule1F1B(stages[0], **kw)
    params = [q for part in parts for q in part.parameters()]
    tied = [dict(part.named_parameters())["wte.weight"] for part in parts if part.first or part.last]
    pair = dist.new_group([0, world - 1]) if world > 2 else dist.group.WORLD
    counted = [q for part in parts for n, q in part.named_parameters() if not (n == "wte.weight" and not part.first)]
    decay = [q for q in params if q.dim() >= 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else nullcontext
    step_s, losses = [], []
    for step in range(a.steps):
        t0 = time.time()
        x, y = (t.to(device) for t in loader.batch(step, 0, plan.seqs_per_rank))
        micro = []  # the last stage's loss of each microbatch
        with autocast():
            sched.step(*((x,) if rank == 0 else ()), **({"target": y, "losses": micro} if rank == world - 1 else {}))
        for w in tied:  # the lookup's and the head's gradients, summed on both copies
            dist.all_reduce(w.grad, group=pair)
        sq = sum(q.grad.float().pow(2).sum() for q in counted if q.grad is not None)
        sq = torch.as_tensor(sq, dtype=torch.float32, device=device)
        dist.all_reduce(sq)
        scale = torch.clamp(cfg.grad_clip / (sq.sqrt() + 1e-6), max=1.0)
        for q in params:
            if q.grad is not None:
                q.grad.mul_(scale)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=cfg.lr, warmup=cfg.warmup_steps, max_steps=a.steps,
                                final_frac=cfg.final_lr_frac)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = torch.as_tensor(sum(loss.detach().float() for loss in micro) if micro else 0.0, device=device).float()
        dist.all_reduce(total)
        losses.append(total.item())
        step_s.append(time.time() - t0)
    return step_s, losses


def zero_offload(a, mcfg, loader, plan, cfg, device, bf16):
    """deepspeed-offload: DeepSpeed's ZeRO-Offload over the transformers model -- ZeRO-2, bf16
    weights on the GPU, the fp32 master and AdamW's moments on the host, updated there by its CPU
    Adam (a C++ extension it compiles on first use); returns step(i) -> the loss."""
    import deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    model = HFLoss(hf_model(mcfg, cfg.seed, device))
    groups = [{"params": [q for q in model.parameters() if q.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [q for q in model.parameters() if q.dim() < 2], "weight_decay": 0.0}]
    conf = {"train_micro_batch_size_per_gpu": a.b, "gradient_accumulation_steps": plan.micro_steps,
            "gradient_clipping": cfg.grad_clip, "bf16": {"enabled": bf16}, "steps_per_print": 1 << 30,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": bf16}},
            "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "betas": [cfg.beta1, cfg.beta2], "eps": cfg.eps,
                                                      "weight_decay": cfg.weight_decay}}}
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=conf)
    first = rank * plan.seqs_per_rank

    def step(i):
        total = torch.zeros((), device=device)
        for group in opt.param_groups:
            group["lr"] = lr_at(i, lr=cfg.lr, warmup=cfg.warmup_steps, max_steps=a.steps, final_frac=cfg.final_lr_frac)
        for micro in range(plan.micro_steps):
            x, y = (t.to(device, non_blocking=True) for t in loader.batch(i, first + micro * a.b, a.b))
            loss = engine(x, y)
            # the token sum over the rank's tokens, as dense()'s (DeepSpeed's own division by the
            # accumulation steps off); it averages the ranks' gradients, then clips and steps at the last
            engine.backward(loss / (plan.total_tokens // world), scale_wrt_gas=False)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        return total.item() / plan.total_tokens

    return step


def dense(a, mcfg, loader, plan, cfg, device, bf16):
    """ddp*, fsdp2*, hf*: the model built, wrapped and given its optimizer; returns step(i) -> the loss."""
    if a.mode == "deepspeed-offload":
        return zero_offload(a, mcfg, loader, plan, cfg, device, bf16)
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.mode.startswith("hf") or "offload" in a.mode:
        model = HFLoss(hf_model(mcfg, cfg.seed, device))
    elif a.mode in titan.MODES:
        model = titan.build(a.mode, mcfg, a.t, device, cfg.seed, world)
    else:
        model = registry.build(mcfg)
        init_weights(model, cfg.seed)
        model = TorchLoss(model.to(device))
    net, sync, autocast = build(a.mode, model, device, bf16)  # FSDP2 replaces the parameters
    decay = [q for q in model.parameters() if q.dim() >= 2]
    rest = [q for q in model.parameters() if q.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    first = rank * plan.seqs_per_rank

    def step(i):
        total = torch.zeros((), device=device)
        for micro in range(plan.micro_steps):
            x, y = loader.batch(i, first + micro * a.b, a.b)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with sync(micro == plan.micro_steps - 1), autocast():
                loss = net(x, y)
                # DDP and FSDP2 average the ranks' gradients: each rank divides by its own tokens,
                # so the average is the global sum over the global count -- braidtrain's gradient
                (loss / (plan.total_tokens // world)).backward()
            total += loss.detach().float()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(i, lr=cfg.lr, warmup=cfg.warmup_steps, max_steps=a.steps, final_frac=cfg.final_lr_frac)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        return total.item() / plan.total_tokens

    return step


def parse(argv=None):
    p = argparse.ArgumentParser(prog="braidtrain.bench.torchref")
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--model", default="gpt2")
    for k in ("--n-layer", "--n-head", "--n-embd", "--n-kv-heads"):
        p.add_argument(k, type=int)
    p.add_argument("-i", "--train-data", required=True)
    p.add_argument("-b", type=int, default=16)
    p.add_argument("-t", type=int, default=1024)
    p.add_argument("-d", type=int)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", required=True)
    p.add_argument("--device")
    return p.parse_args(argv)


def setup(a):
    """The process group joined; (device, bf16, cfg, plan, model config, loader) for these arguments."""
    backend = "nccl" if torch.cuda.is_available() and a.device != "cpu" else "gloo"
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group(backend)
    else:  # one process started by hand: a group of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if a.device == "cpu" or not torch.cuda.is_available():
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    cfg = build_config(None, dict(model=a.model, train_data=a.train_data, batch_size=a.b, seq_len=a.t,
                                  total_batch=a.d, max_steps=a.steps))  # the preset's recipe, as `train`'s
    dp = 1 if a.mode.startswith("pipe") else dist.get_world_size()
    plan = batch_plan(cfg.total_batch, cfg.batch_size, cfg.seq_len, dp)
    cfg = batch_scaled(cfg, plan.total_tokens)
    files = resolve_files(a.train_data, "train")
    data = TokenData(files, data_tokenizer(files)[1])
    mcfg = registry.model_config(a.model, data.vocab_size, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd,
                                 n_kv_heads=a.n_kv_heads)
    return device, device.type == "cuda", cfg, plan, mcfg, Loader(data, a.t, plan.seqs_per_step, cfg.seed)


def main(argv=None) -> None:
    a = parse(argv)
    device, bf16, cfg, plan, mcfg, loader = setup(a)
    rank, world = dist.get_rank(), dist.get_world_size()
    pipe = a.mode.startswith("pipe")
    if pipe:
        step_s, losses = run_pipe(a, mcfg, loader, plan, cfg, device, bf16)
        write(a, rank, world, device, bf16, step_s, losses, plan, mcfg)
        return  # (no destroy_process_group: on gloo it could hang once a peer had gone; os._exit below)

    run = dense(a, mcfg, loader, plan, cfg, device, bf16)
    step_s, losses = [], []
    for step in range(a.steps):
        t0 = time.time()
        losses.append(run(step))  # (the host waits for the step's loss: the step is done)
        step_s.append(time.time() - t0)
    write(a, rank, world, device, bf16, step_s, losses, plan, mcfg)
    # no destroy_process_group: on gloo it hung now and then once the peer had written and gone
    # (2 runs in 5 of the suite's bench test); every rank is past the last all_reduce, os._exit ends it


def write(a, rank, world, device, bf16, step_s, losses, plan, mcfg) -> None:
    if rank == 0:
        mem = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
        peak = peak_flops(device, bf16)
        with open(a.json, "w") as f:
            json.dump({"mode": a.mode, "world_size": world, "step_s": step_s, "loss": losses, "mem_gb": mem,
                       "tokens_per_step": plan.total_tokens, "flops_per_token": mcfg.flops_per_token(a.t),
                       "peak_flops": peak and peak * world,
                       "host_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}, f)  # (KiB)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown after collectives: see braidtrain.cli.run
