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

Where the experts run is the dispatch's: `Dispatch` here, every expert on this rank; under
expert parallelism parallel/expert.py's, which sends the tokens to their experts' ranks.
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


class Dispatch:
    """How one rank's tokens reach the experts, all of them on this rank (parallel/expert.py's
    subclass shards them over the ep group). `exact`: each source's rows through an expert in their
    own call (set by build for exact mode); `sink` (exact mode at ep > 1, set by the engine) takes
    each source's gradients."""

    n = 1  # ranks the experts are sharded over

    def __init__(self, exact: bool = False):
        self.exact, self.sink = exact, None
        self.grouped = True  # on CUDA in bf16: one grouped GEMM (False: a loop, for benchmarks/moe_gpu.py)

    def experts_of(self, E: int, r: int) -> range:
        return range(r * E // self.n, (r + 1) * E // self.n)

    def __call__(self, xs, idx, keep, moe):
        """The expert outputs (N, k, C) of tokens xs (N, C) routed to experts idx (N, k); `keep`
        (N, k) marks the assignments within capacity, zero output elsewhere (None: dropless).
        The kept assignments sorted expert-major, token order within an expert (each token meets an
        expert at most once), run through the experts (`_run`), and put back in place per (token,
        slot) by index -- no atomics, each place written once."""
        N, k = idx.shape
        expert = idx.reshape(-1)  # assignment a = token * k + slot
        if keep is not None:
            kept = keep.reshape(-1).nonzero().squeeze(1)
            order = kept[torch.sort(expert[kept], stable=True).indices]  # expert-major, token order
        else:  # dropless: every assignment (and no wait for the GPU)
            order = torch.sort(expert, stable=True).indices
        rows = xs[order // k]
        if torch.is_autocast_enabled(xs.device.type):  # travel and compute in the autocast dtype
            rows = rows.to(torch.get_autocast_dtype(xs.device.type))
        counts = torch.zeros(moe.E, dtype=torch.long, device=xs.device).scatter_add_(0, expert[order], torch.ones_like(order))
        out = self._run(rows, counts, moe)
        y = out.new_zeros(N * k, out.shape[-1]).index_copy(0, order, out)
        return y.view(N, k, -1)

    def _run(self, rows, counts, moe):
        """Every expert over its run of rows (counts[e] of them, in order)."""
        local = local_experts(moe)
        if self._grouped(rows, moe):  # (the counts stay on the GPU)
            return grouped(rows, counts, local)
        c = counts.tolist()
        return compute(rows, c, local, [[x] for x in c], self.exact)

    def _grouped(self, rows, moe) -> bool:
        """On CUDA in bf16, outside exact mode, with rows to compute (a grouped GEMM of none raises;
        the loop keeps the experts in the graph), widths of whole 16-byte rows: one grouped GEMM."""
        return (self.grouped and not self.exact and rows.is_cuda and rows.dtype == torch.bfloat16 and rows.shape[0] > 0
                and hasattr(torch, "_grouped_mm") and rows.shape[-1] % 8 == 0 and moe.width % 8 == 0)


def local_experts(moe) -> list:
    return [moe.experts[str(e)] for e in sorted(int(i) for i in moe.experts)]


def compute(rows, counts: list[int], experts, parts: list[list[int]], exact: bool, tap=None):
    """The experts over their runs of rows (counts[e] rows each, in order), one call each. In
    exact mode each expert's run in `parts` pieces (one per source rank, empty ones too), each its
    own call; `tap(weight, source)`: the weights that source's call uses (parallel/expert.py)."""
    outs = []
    for ex, piece, sizes in zip(experts, rows.split(counts), parts):
        for s, p in enumerate(piece.split(sizes if exact else [piece.shape[0]])):
            outs.append(ex(p, [tap(w, s) for w in ex.weights()] if tap is not None else None))
    return torch.cat(outs) if outs else rows.new_zeros(0, rows.shape[-1])


def grouped(rows, counts, experts):
    """All experts in two grouped GEMMs (torch._grouped_mm: one launch, each expert its run of
    rows; counts a device tensor). Each row's bias is its expert's, picked by a matmul with the
    rows' one-hot expert matrix, so that its gradient is one too (a gather's would be an
    index_put that adds with atomics: 20 of 31 ms of a layer's step on the H200, measured)."""
    dt, E = rows.dtype, len(experts)
    offs = counts.cumsum(0).to(torch.int32)
    which = torch.repeat_interleave(torch.arange(E, device=rows.device), counts, output_size=rows.shape[0])
    onehot = (which[:, None] == torch.arange(E, device=rows.device)).to(dt)  # (rows, E)
    w1, b1, w2, b2 = (torch.stack(ws).to(dt) for ws in zip(*(e.weights() for e in experts)))  # (E, H, C) ...
    h = torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offs) + onehot @ b1
    return torch._grouped_mm(F.gelu(h, approximate="tanh"), w2.transpose(-2, -1), offs=offs) + onehot @ b2
