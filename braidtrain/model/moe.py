"""A mixture of experts in place of a block's MLP (Shazeer et al. 2017; GShard, Lepikhin et al.
2020; Switch, Fedus et al. 2021).

    x (N tokens, C) -> router (C -> E, no bias) -> softmax (fp32) -> top-k experts per token,
    their k probabilities renormalised to sum to 1 -> each token through its k experts (each the
    dense MLP's shape, or --moe-hidden H) -> out = sum over the k slots of weight x expert output

Capacity (`--moe-capacity C`, 0: dropless). Each expert takes at most ceil(C * N * k / E) of the
N tokens a rank routes in one forward (its micro-batch), first come in priority order: every
token's first choice, in token order, before any second choice (GShard's). An assignment over
capacity skips its expert (its term of the sum is zero; the block's residual carries the token
on). The capacity group is one rank's micro-batch -- the same tokens at any dp or ep -- so which
tokens are dropped does not depend on the layout (under cp a rank's micro-batch is its t/cp
tokens, under sp its t/tp rows: they change the groups, as cp changes attention's sums).
Capacity is a training setting: a forward outside training (model.eval(): the validation loss,
the multiple-choice evaluation, sampling) routes dropless, so what it computes for a sequence does
not depend on the sequences beside it, their padding, or how the layout deals them out.

Load balance: the Switch/GShard loss E * sum_i f_i * P_i over a rank's micro-batch, f_i the share
of the k*N assignments routed to expert i (before capacity), P_i the mean router probability of
expert i; 1 when balanced. Its coefficient `--moe-aux` weighs it into the training loss, as one
more term of the loss sum per token (so `coef * aux * N`, divided once by the global token count
like every token's loss). It enters the gradient only: `AuxLoss` leaves the block's output as it
is and, in the backward, gives the aux term the loss's weight -- so a pipeline stage's experts add
their term without the loss passing through them, and the logged loss stays the language model's.
`moe_aux` is logged beside it (the mean over layers and micro-batches), with `moe_dropped` and the
experts' load.

Where the experts run is parallel/expert.py's (this rank's experts, the all-to-all over ep).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    """One expert: an MLP, replicated over tp (its parameters are placed as expert parameters:
    `expert`, reduced over the ranks that hold the same experts)."""

    expert = True

    def __init__(self, n_embd: int, hidden: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, hidden)
        self.c_proj = nn.Linear(hidden, n_embd)

    def forward(self, x, weights=None):
        """`weights`: (c_fc weight, bias, c_proj weight, bias) to use instead of the parameters
        (exact mode's taps: parallel/expert.py)."""
        w1, b1, w2, b2 = weights or (self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias)
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)

    def weights(self):
        return self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias


def route(logits: torch.Tensor, k: int, capacity: float):
    """(weights (N, k) renormalised, experts (N, k), kept (N, k) bool, aux 0-d, assignments per
    expert (E,) before capacity) for router logits (N, E)."""
    N, E = logits.shape
    probs = logits.float().softmax(-1)
    w, idx = probs.topk(k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    onehot = (idx.t().reshape(-1, 1) == torch.arange(E, device=idx.device)).long()  # (k N, E): in priority order
    routed = onehot.sum(0)
    keep = torch.ones_like(idx, dtype=torch.bool)
    if capacity > 0:
        pos = (onehot.cumsum(0) * onehot).sum(-1) - 1  # each assignment's place in its expert's queue
        keep = (pos < capacity_of(capacity, N, k, E)).view(k, N).t()
    aux = E * (routed.float() / (k * N) * probs.mean(0)).sum()
    return w, idx, keep, aux, routed


def capacity_of(factor: float, n_tokens: int, k: int, experts: int) -> int:
    return math.ceil(factor * n_tokens * k / experts)


class AuxLoss(torch.autograd.Function):
    """Forward: `out` unchanged. Backward: `out`'s gradient, and `scale` for the aux term (its
    weight in the loss: 1 / the global token count)."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, device=grad.device), None


class MoE(nn.Module):
    """The router and this rank's experts (global indices `experts`), in place of Block.mlp.
    `dispatch` (parallel/expert.py) runs the tokens through the experts wherever they live;
    `loss_scale` is the aux term's weight (set by build: 1 / tokens a step)."""

    def __init__(self, cfg, experts: range, dispatch):
        super().__init__()
        self.E, self.k = cfg.moe_experts, cfg.moe_top_k
        self.capacity, self.aux_coef = cfg.moe_capacity, cfg.moe_aux
        self.router = nn.Linear(cfg.n_embd, self.E, bias=False)
        self.width = cfg.moe_width
        self.experts = nn.ModuleDict({str(e): Expert(cfg.n_embd, self.width) for e in experts})
        self.dispatch = dispatch
        self.loss_scale = 0.0
        self.stats, self.counted = torch.zeros(0), [0, 0]  # this step's: (aux sum, dropped, kept per expert), (forwards, assignments)

    def forward(self, x):
        shape, N = x.shape, x.shape[:-1].numel()
        xs = x.reshape(N, shape[-1])
        capacity = self.capacity if self.training else 0.0  # evaluation and sampling: dropless
        w, idx, keep, aux, routed = route(self.router(xs), self.k, capacity)
        y = self.dispatch(xs, idx, keep if capacity > 0 else None, self)  # (N, k, C): zero where dropped
        out = (y * (w * keep).unsqueeze(-1).to(y.dtype)).sum(1)
        if self.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self._record(aux, keep, idx)  # (a training forward: not validation, sampling, a recomputation)
        if torch.is_grad_enabled() and self.aux_coef and self.loss_scale:
            out = AuxLoss.apply(out, self.aux_coef * N * aux, self.loss_scale)
        return out.view(shape)

    @torch.no_grad()
    def _record(self, aux, keep, idx):
        """(On the device, without waiting for it: the step's figures are read once, at its end.)"""
        kept = torch.zeros(self.E, device=idx.device).scatter_add_(0, idx.reshape(-1), keep.reshape(-1).float())
        row = torch.cat([aux.detach().float().view(1), (keep.numel() - kept.sum()).view(1), kept])
        self.stats = row if self.stats.numel() == 0 else self.stats + row
        self.counted = [self.counted[0] + 1, self.counted[1] + keep.numel()]
