"""AdamW over flat shards, the learning-rate schedule, and gradient clipping.

The optimizer never sees a parameter: it sees the (parameter shard, gradient shard) pairs the
data-parallel engine says this rank owns -- whole buckets under ZeRO-0, one shard of each bucket
under ZeRO-1 -- and keeps m and v for exactly those elements. Every operation is elementwise, so
the update of an element does not depend on where the shard boundaries fall (checked bitwise by
the exact-mode tests), and weight decay applies to the ranges of the shard that hold 2-D weights.
"""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, lr: float, warmup: int, max_steps: int, final_frac: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to lr * final_frac at max_steps."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if max_steps <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return lr * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


class AdamW:
    def __init__(self, engine, *, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        self.engine = engine
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.step_count = 0
        self.groups = []  # (m, v, ranges of 2-D weights), one per owned shard
        for b, p, _ in engine.owned():
            self.groups.append((torch.zeros_like(p), torch.zeros_like(p), engine.decay_segments(b)))

    def state_numel(self) -> int:
        """Elements of m (equally of v) held by this rank."""
        return sum(m.numel() for m, _, _ in self.groups)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.step_count += 1
        t = self.step_count
        bc1, bc2 = 1 - self.beta1**t, 1 - self.beta2**t
        # the gradient shards are fetched each step: in exact mode they are fresh tree buffers
        for (_, p, g), (m, v, decay) in zip(self.engine.owned(), self.groups):
            m.lerp_(g, 1 - self.beta1)
            v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
            denom = (v / bc2).sqrt_().add_(self.eps)
            if self.weight_decay:  # decoupled decay, 2-D weights only
                for a, e in decay:
                    p[a:e].mul_(1 - lr * self.weight_decay)
            p.addcdiv_(m, denom, value=-lr / bc1)


def clip_factor(norm: float, max_norm: float) -> float:
    """The factor that brings the global gradient norm down to max_norm (1.0 if already below)."""
    if max_norm <= 0 or not math.isfinite(norm) or norm <= max_norm:
        return 1.0
    return max_norm / (norm + 1e-6)
