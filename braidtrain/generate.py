"""Sampling: text from a model, for the end of a run and `braidtrain sample`."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F


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
