"""A mixture of experts in place of a block's MLP (Shazeer et al. 2017; GShard, Lepikhin et al.
2020; Switch, Fedus et al. 2021; Mixtral, Jiang et al. 2024; DeepSeek-V3, 2024).

    x (N tokens, C) -> router (C -> E, no bias) -> softmax (fp32) -> top-k experts per token,
    their k probabilities renormalised to sum to 1 -> each token through its k experts -> out =
    sum over the k slots of weight x expert output (+ the shared experts' output, which every
    token passes)

The experts are the family's: GPT-2's `GeluExperts` (the dense MLP's shape, biases), Llama's
`SwiGLUExperts` (no biases: Mixtral, Qwen3-MoE; fine-grained ones with a small --moe-hidden and a
large k, DeepSeek's). Routers (`--moe-router`): "softmax-topk" softmaxes all E logits, keeps the
top k and renormalises them (HuggingFace's Mixtral and Qwen3-MoE compute it so); "topk-softmax"
softmaxes the top k logits alone (Mixtral's paper) -- the same weights up to rounding.

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

Balance (`--moe-balance`). "aux": the Switch/GShard loss E * sum_i f_i * P_i over a rank's
micro-batch, f_i the share of the k*N assignments routed to expert i (before capacity), P_i the
mean router probability of expert i; 1 when balanced. Its coefficient `--moe-aux` weighs it into
the training loss, as one more term of the loss sum per token (so `coef * aux * N`, divided once by
the global token count like every token's loss). It enters the gradient only: `AuxLoss` leaves the
block's output as it is and, in the backward, gives the aux term the loss's weight -- so a
pipeline stage's experts add their term without the loss passing through them, and the logged
loss stays the language model's. "bias" (DeepSeek-V3's auxiliary-loss-free balancing): no loss
term; a per-expert bias, added to the probabilities to choose the top k only (the weights stay
the probabilities), moves after each step by --moe-bias-rate against the expert's load: down if
it took more than the mean, up if less (train.py: the step's loads summed over every rank, so
every rank's biases stay equal; checkpoints keep them). `moe_aux`, `moe_dropped` and the experts'
load are logged either way.

Where the experts run is the dispatch's: `Dispatch` here, every expert on this rank; under
expert parallelism parallel/expert.py's, which sends the tokens to their experts' ranks. Outside
exact mode at ep 1 nothing here waits for the device: the assignments are sorted on it, every
assignment is computed (one dropped by capacity is computed and weighted 0: the shapes stay the
same every step, so --compile and --cuda-graph take the layer), and the experts run as one grouped
GEMM whose group boundaries stay on the device.

A rank's experts of one layer are stacked: one parameter per weight kind, dim 0 the experts
(`Stacked`). The grouped GEMM reads the stack as it is (under autocast one cast of it a step, not
a stack and a cast of E tensors) and its gradient lands in one tensor; the per-expert loop (exact
mode; where no grouped GEMM runs) computes on the stack's slices, each laid out as a per-expert
nn.Linear's weight, so its bits are those of per-expert parameters. Expert parallelism shards dim
0 (parallel/placement.py); initialisation draws each expert's slice from its own generator.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from braidtrain.model.swiglu import swiglu

ROUTERS = ("softmax-topk", "topk-softmax")
BALANCES = ("aux", "bias")


class Stacked(nn.Module):
    """n experts' weights of one linear layer, stacked: `weight` (n, out, in) -- each expert's slice
    laid out as nn.Linear's, so that a slice is the matrix a per-expert call takes and the stack is
    what a grouped GEMM reads (transposed: a view) --, and `bias` (n, out) if any. Initialised as
    nn.Linear (U(+-1/sqrt(in))); a run's init is placement.init_weights', expert by expert."""

    def __init__(self, n: int, n_in: int, n_out: int, bias: bool):
        super().__init__()
        bound = n_in ** -0.5
        self.weight = nn.Parameter(torch.empty(n, n_out, n_in).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(n, n_out).uniform_(-bound, bound)) if bias else None


class GeluExperts(nn.Module):
    """GPT-2's experts, n of them (this rank's): MLPs with biases, the dense MLP's shape, stacked --
    c_fc.weight (n, H, C), c_fc.bias (n, H), c_proj.weight (n, C, H), c_proj.bias (n, C) --,
    replicated over tp; placed as expert parameters (`expert`: dim 0 the experts, reduced over
    the ranks that hold the same experts)."""

    expert = True

    def __init__(self, n: int, n_embd: int, hidden: int):
        super().__init__()
        self.c_fc = Stacked(n, n_embd, hidden, bias=True)
        self.c_proj = Stacked(n, hidden, n_embd, bias=True)

    def weights(self):
        return self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias

    @staticmethod
    def one(x, weights):
        """One expert over its rows x; `weights`: its slices of weights()."""
        w1, b1, w2, b2 = weights
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)

    def grouped(self, rows, offs, which):
        """All experts in two grouped GEMMs (torch._grouped_mm: one launch, each expert its run of
        rows) that read the stacked weights (one cast of each under autocast). Each row's bias is
        its expert's, picked by a matmul with the rows' one-hot expert matrix, so that its gradient
        is one too (a gather's would be an index_put that adds with atomics: 20 of 31 ms of a
        layer's step on the H200, measured)."""
        dt = rows.dtype
        w1, b1, w2, b2 = (w.to(dt) for w in self.weights())  # (n, H, C), (n, H), (n, C, H), (n, C)
        onehot = (which[:, None] == torch.arange(w1.shape[0], device=rows.device)).to(dt)  # (rows, n)
        h = torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offs) + onehot @ b1
        return torch._grouped_mm(F.gelu(h, approximate="tanh"), w2.transpose(-2, -1), offs=offs) + onehot @ b2


class SwiGLUExperts(nn.Module):
    """Llama's experts (Mixtral's, Qwen3-MoE's), n of them: down(silu(gate x) * up x), gate and up
    one packed matmul, no biases -- gate_up_proj.weight (n, 2H, C), down_proj.weight (n, C, H) --;
    replicated over tp."""

    expert = True
    fused_swiglu = False  # the grouped path's silu(gate) * up as model/swiglu.py's operator (Stage.use_fused_kernels)

    def __init__(self, n: int, n_embd: int, hidden: int):
        super().__init__()
        self.gate_up_proj = Stacked(n, n_embd, 2 * hidden, bias=False)
        self.down_proj = Stacked(n, hidden, n_embd, bias=False)

    def weights(self):
        return self.gate_up_proj.weight, self.down_proj.weight

    @staticmethod
    def one(x, weights):
        w13, w2 = weights
        gate, up = F.linear(x, w13).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2)

    def grouped(self, rows, offs, which):
        w13, w2 = (w.to(rows.dtype) for w in self.weights())  # (n, 2H, C), (n, C, H)
        gate_up = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs)
        if self.fused_swiglu:
            return torch._grouped_mm(swiglu(gate_up), w2.transpose(-2, -1), offs=offs)
        gate, up = gate_up.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)


def route(logits: torch.Tensor, k: int, capacity: float, bias=None, router: str = "softmax-topk", renorm: bool = True):
    """(weights (N, k), experts (N, k), kept (N, k) bool, aux 0-d, assignments per expert (E,)
    before capacity) for router logits (N, E); `bias` (E,): added to choose the experts only;
    `renorm`: softmax-topk's k weights made to sum to 1 (else the probabilities as they are)."""
    N, E = logits.shape
    probs = logits.float().softmax(-1)
    if router == "topk-softmax":  # the top k logits, softmaxed on their own
        top = logits.float() if bias is None else logits.float() + bias
        idx = top.topk(k, dim=-1).indices
        w = logits.float().gather(1, idx).softmax(-1)
    else:
        idx = (probs if bias is None else probs + bias).topk(k, dim=-1).indices
        w = probs.gather(1, idx)
        w = w / w.sum(-1, keepdim=True) if renorm else w
    flat = idx.t().reshape(-1)  # the k N assignments in priority order: every first choice, then every second ...
    routed = torch.zeros(E, device=idx.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
    keep = torch.ones_like(idx, dtype=torch.bool)
    if capacity > 0:  # each assignment's place in its expert's queue, by a stable sort (no one-hot of k N x E)
        order = torch.sort(flat, stable=True).indices
        starts = torch.cumsum(routed, 0).long() - routed.long()
        place = torch.empty_like(flat)
        place[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        keep = (place < capacity_of(capacity, N, k, E)).view(k, N).t()
    aux = E * (routed / (k * N) * probs.mean(0)).sum()
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
    """The router and this rank's experts (global indices `experts`, kept as `held`; a module of
    class `expert` holding them stacked), in place of a block's MLP, and `shared` (a dense MLP every
    token passes, or None). `dispatch` runs the tokens through the experts wherever they live;
    `loss_scale` is the aux term's weight (set by build: 1 / tokens a step)."""

    def __init__(self, cfg, experts: range, dispatch, expert=GeluExperts, shared=None):
        super().__init__()
        self.E, self.k = cfg.moe_experts, cfg.moe_top_k
        self.capacity, self.aux_coef = cfg.moe_capacity, cfg.moe_aux
        self.router_kind, self.balance, self.renorm = cfg.moe_router, cfg.moe_balance, cfg.moe_renorm
        self.router = nn.Linear(cfg.n_embd, self.E, bias=False)
        self.width = cfg.moe_width
        self.held = experts
        self.experts = expert(len(experts), cfg.n_embd, self.width)
        self.shared = shared
        self.dispatch = dispatch
        self.loss_scale = 0.0
        # bias balancing: the per-expert bias (train.py moves it and keeps it in checkpoints)
        self.register_buffer("bias", torch.zeros(self.E), persistent=False)
        # a training forward's figures (`last`: forwards, assignments, aux, dropped, then routed and
        # kept per expert), summed on the device over a step's training forwards in `stats` by the
        # block (protocol.Block: not a recomputation's), read and zeroed once a step by train.py
        self.register_buffer("last", torch.zeros(4 + 2 * self.E), persistent=False)
        self.register_buffer("stats", torch.zeros(4 + 2 * self.E), persistent=False)

    def forward(self, x):
        shape, N = x.shape, x.shape[:-1].numel()
        xs = x.reshape(N, shape[-1])
        capacity = self.capacity if self.training else 0.0  # evaluation and sampling: dropless
        bias = self.bias if self.balance == "bias" else None
        w, idx, keep, aux, routed = route(self.router(xs), self.k, capacity, bias, self.router_kind, self.renorm)
        y = self.dispatch(xs, idx, keep if capacity > 0 else None, self)  # (N, k, C): zero where dropped
        out = (y * (w * keep).unsqueeze(-1).to(y.dtype)).sum(1)
        if self.shared is not None:  # (on x as it came: under sp the shared MLP gathers its sequence)
            out = out + self.shared(x).reshape(N, shape[-1])
        if self.training and torch.is_grad_enabled():  # (a training forward: not validation, sampling)
            self._record(aux, keep, idx, routed)
        if torch.is_grad_enabled() and self.aux_coef and self.loss_scale and self.balance == "aux":
            out = AuxLoss.apply(out, self.aux_coef * N * aux, self.loss_scale)
        return out.view(shape)

    @torch.no_grad()
    def _record(self, aux, keep, idx, routed):
        """(On the device, in place, without waiting for it: a captured step replays it.)"""
        kept = torch.zeros(self.E, device=idx.device).scatter_add_(0, idx.reshape(-1), keep.reshape(-1).float())
        one = torch.ones(1, device=idx.device)
        self.last.copy_(torch.cat([one, one * keep.numel(), aux.detach().float().view(1),
                                   (keep.numel() - kept.sum()).view(1), routed, kept]))


@torch.no_grad()
def move_bias(bias, loads, rate: float) -> None:
    """DeepSeek-V3's update of the experts' biases (layers, E) from a step's loads (layers, E,
    summed over every rank): each expert's down by `rate` if it took more than its layer's mean,
    up if less. Rows of no load (dense layers) stay 0."""
    bias.add_(rate * torch.sign(loads.mean(-1, keepdim=True) - loads))


class Dispatch:
    """How one rank's tokens reach the experts, all of them on this rank (parallel/expert.py's
    subclass shards them over the ep group). `exact`: each source's rows through an expert in their
    own call (set by build for exact mode); `sink` (exact mode at ep > 1, set by the engine) takes
    each source's gradients."""

    n = 1  # ranks the experts are sharded over

    def __init__(self, exact: bool = False):
        self.exact, self.sink = exact, None
        self.grouped = True  # one grouped GEMM (False: a loop, for benchmarks/kernels/moe_gpu.py)

    def experts_of(self, E: int, r: int) -> range:
        return range(r * E // self.n, (r + 1) * E // self.n)

    def __call__(self, xs, idx, keep, moe):
        """The expert outputs (N, k, C) of tokens xs (N, C) routed to experts idx (N, k); `keep`
        (N, k) marks the assignments within capacity, zero output elsewhere (None: dropless).
        The assignments sorted expert-major, token order within an expert (each token meets an
        expert at most once), run through the experts (`_run`), and put back in place per (token,
        slot) by index -- no atomics, each place written once. Outside exact mode at ep 1 every
        assignment runs (a dropped one is weighted 0 by the caller): shapes that do not change."""
        N, k = idx.shape
        expert = idx.reshape(-1)  # assignment a = token * k + slot
        if keep is not None and (self.exact or self.n > 1):  # only the kept ones (a wait for the device)
            kept = keep.reshape(-1).nonzero().squeeze(1)
            order = kept[torch.sort(expert[kept], stable=True).indices]  # expert-major, token order
        else:
            order = torch.sort(expert, stable=True).indices
        rows = xs[order // k]
        if torch.is_autocast_enabled(xs.device.type):  # travel and compute in the autocast dtype
            rows = rows.to(torch.get_autocast_dtype(xs.device.type))
        counts = torch.zeros(moe.E, dtype=torch.long, device=xs.device)
        counts.scatter_add_(0, expert[order], torch.ones_like(order))
        out = self._run(rows, counts, moe)
        y = out.new_zeros(N * k, out.shape[-1]).index_copy(0, order, out)
        return y.view(N, k, -1)

    def _run(self, rows, counts, moe):
        """Every expert over its run of rows (counts[e] of them, in order)."""
        if self._grouped(rows, moe):  # (the counts stay on the device)
            return grouped(rows, counts, moe.experts)
        c = counts.tolist()
        return compute(rows, c, moe.experts, [[x] for x in c], self.exact)

    def _grouped(self, rows, moe) -> bool:
        """Outside exact mode, with rows to compute (a grouped GEMM of none raises; the loop keeps
        the experts in the graph): in bf16 with widths of whole 16-byte rows (CUDA's kernel needs
        them), or on the CPU in fp32 outside torch.compile (whose grouped GEMM takes bf16 only)."""
        if not self.grouped or self.exact or rows.shape[0] == 0 or not hasattr(torch, "_grouped_mm"):
            return False
        if rows.dtype == torch.bfloat16:
            return rows.shape[-1] % 8 == 0 and moe.width % 8 == 0
        return not rows.is_cuda and rows.dtype == torch.float32 and not torch.compiler.is_compiling()


def grouped(rows, counts, experts):
    """The experts (a stacked module) over their runs of rows in grouped GEMMs: the runs' ends
    (`offs`) and each row's expert (`which`) computed on the device."""
    offs = counts.cumsum(0).to(torch.int32)
    mine = torch.arange(counts.shape[0], device=rows.device)
    which = torch.repeat_interleave(mine, counts, output_size=rows.shape[0])
    return experts.grouped(rows, offs, which)


def compute(rows, counts: list[int], experts, parts: list[list[int]], exact: bool, tap=None):
    """The experts (a stacked module) over their runs of rows (counts[e] rows each, in order), one
    call each, on their slices of the stacked weights (unbind: whose backward stacks the slices'
    gradients, one copy). In exact mode each expert's run in `parts` pieces (one per source rank,
    empty ones too), each its own call; `tap(weight, source)`: the stacked weights that source's
    calls use (parallel/expert.py)."""
    split = {}

    def weights(s: int) -> list:  # [expert][kind]: the slices source s's calls use
        key = s if tap is not None else None
        if key not in split:
            split[key] = list(zip(*((w if tap is None else tap(w, s)).unbind(0) for w in experts.weights())))
        return split[key]

    outs = []
    for e, (piece, sizes) in enumerate(zip(rows.split(counts), parts)):
        for s, p in enumerate(piece.split(sizes if exact else [piece.shape[0]])):
            outs.append(experts.one(p, weights(s)[e]))
    return torch.cat(outs) if outs else rows.new_zeros(0, rows.shape[-1])
