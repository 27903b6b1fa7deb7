"""Sampling: text from a model, for the end of a run and `braidtrain sample`."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F


@torch.no_grad()
def generate(logits_of, prompt: list[int], n: int, *, block_size: int, device, mult: int = 1,
             temperature: float = 0.8, top_k: int = 40, seed: int = 0, share=None) -> list[int]:
    """Sample n tokens after the prompt (top-k, temperature), cropping to the context.
    `logits_of(ctx)`: the logits (1, T, V) of token ids ctx (1, T), or None on a rank that does
    not hold the head (a pipeline's other stages); `share(token)`: the token, sampled where the
    logits are, on every rank. `mult`: sequence parallelism needs a length divisible by tp, so the
    context is padded on the right -- which (causal attention) leaves the real positions' logits
    unchanged."""
    g = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    for _ in range(n):
        ctx = idx[:, -(block_size // mult * mult) :]
        logits = logits_of(F.pad(ctx, (0, -ctx.shape[1] % mult)))
        nxt = None
        if logits is not None:
            logits = logits[:, ctx.shape[1] - 1, :].float() / temperature
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits[logits < kth] = -float("inf")
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
        if share is not None:
            nxt = share(nxt)
        idx = torch.cat([idx, nxt.to(device)], dim=1)
    return idx[0, len(prompt) :].tolist()


def sample_prompt(tok, data, look: int = 4096, most: int = 64) -> list[int]:
    """The end-of-run sample's prompt, from the validation text (never trained on): the first
    line of its first paragraph of two or more lines -- in a play, a speaker's name, whose speech
    the model then writes. [] when the text has no such paragraph (the caller starts from eot)."""
    text = tok.decode(data.window(0, min(look, data.n_tokens)).tolist())
    m = re.search(r"\n[ \t]*\n([^\n]*\S[^\n]*\n)[^\n]*\S", text)
    return tok.encode(m.group(1))[:most] if m else []
