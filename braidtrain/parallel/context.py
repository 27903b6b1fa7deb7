"""Context parallelism: each sequence of a replica split over its cp ranks, attention computed
block by block while keys and values move between them (Liu et al., "Ring Attention", 2023;
the load-balanced split of Megatron and Transformer Engine).

The split. A sequence of T tokens is cut into 2·cp chunks of c = T/(2·cp); rank r holds chunks
r and 2·cp−1−r ("zigzag"): under a causal mask an early chunk attends to few keys and a late one
to many, so each rank gets one of each and the same work (2·cp+1 block pairs). "contiguous"
(chunks 2r and 2r+1) is there to show the imbalance (4r+3 pairs on rank r). Positions and targets
follow the tokens (`token_index`); the loss sums over every token once, each rank its own.

The ring (`impl="ring"`). Step s of cp: rank r holds the keys and values of rank (r−s) mod cp,
sends them on to r+1 and receives the next ones from r−1 (comm.send_recv on the cp group) while
it computes attention of its two query chunks against the two key chunks it holds -- pairs with
the key chunk after the query chunk are skipped, the equal ones are causal, the earlier ones
full. Each pair gives an output and its log-sum-exp (fp32); outputs are merged in ring order,
o = o·e^(l−l') + o_b·e^(l_b−l') with l' = logaddexp(l, l_b). The backward goes round again:
keys and values travel as before, with the fp32 gradients of the ones held (dK, dV) travelling
beside them, each rank adding its share, until after cp steps they are back with their owner.

`impl="allgather"` (Llama 3's): keys and values all-gathered once per layer, the same pairs in
the same order (the forward's bits are the ring's), and in the backward the gradients of every
rank's keys and values reduce-scattered back (exact mode: comm's exact reduce-scatter, a fixed
tree in rank order).

Grouped-query attention (Llama's): keys and values have fewer heads than queries; only those
travel the ring (or are gathered), each block pair repeats them for its query heads
(layers.repeat_kv) and sums their gradients back (fold_kv). Rotary positions were applied before,
at each token's position in the whole sequence (the model's `positions`).

A block pair on CUDA in half precision is torch's flash attention (its log-sum-exp returned;
its backward given the merged output and log-sum-exp); on the CPU, in fp32 and in exact mode
(flash's backward is not deterministic) it is plain fp32 matrix products (softmax over a c×c
block, masked on the diagonal; tile by tile of query rows, so that only one tile's scores exist
at a time): deterministic, so exact mode holds at a fixed cp. Changing cp changes the order of
the sums, and so the bits (as tp does). A model outside training (sampling)
sets `active = False` and sees whole sequences, attention then local.
"""

from __future__ import annotations

import math
import time
from collections import deque

import torch

from braidtrain.model.layers import repeat_kv

ORDERS = ("zigzag", "contiguous")
IMPLS = ("ring", "allgather")


def chunks_of(cp: int, r: int, order: str = "zigzag") -> tuple[int, int]:
    """The two chunks (of 2·cp) of each sequence that cp rank r holds, in sequence order."""
    return (r, 2 * cp - 1 - r) if order == "zigzag" else (2 * r, 2 * r + 1)


def token_index(T: int, cp: int, r: int, order: str = "zigzag") -> torch.Tensor:
    """The positions in a sequence of T tokens of cp rank r's T/cp tokens, in its order."""
    c = T // (2 * cp)
    return torch.cat([torch.arange(j * c, (j + 1) * c) for j in chunks_of(cp, r, order)])


def block_pairs(cp: int, r: int, src: int, order: str = "zigzag") -> list[tuple[int, int, bool]]:
    """(query chunk, key chunk, diagonal) of rank r's queries against rank src's keys that the
    causal mask leaves anything of: local indices 0/1 into each rank's two chunks."""
    mine, theirs = chunks_of(cp, r, order), chunks_of(cp, src, order)
    return [(a, b, kj == qi) for a, qi in enumerate(mine) for b, kj in enumerate(theirs) if kj <= qi]


class Context:
    """One rank's context parallelism: its cp group, the implementation and chunk order, and
    what the tests read (`pairs`: block pairs computed; `events`: for each ring step with a
    transfer, when comm launched it, when the step's attention began and when it was done and
    the transfer waited for, host clock)."""

    def __init__(self, group, impl: str = "ring", order: str = "zigzag", exact: bool = False):
        self.group, self.comm, self.impl, self.order, self.exact = group, group.comm, impl, order, exact
        self.n, self.r = group.size, group.index
        self.active = True
        self.pairs = 0
        self.events: deque[tuple[float, float, float]] = deque(maxlen=64)  # the latest ring steps'
        self._positions: dict = {}

    def positions(self, T_local: int, device) -> torch.Tensor:
        key = (T_local, str(device))
        if key not in self._positions:
            self._positions[key] = token_index(T_local * self.n, self.n, self.r, self.order).to(device)
        return self._positions[key]

    def attend(self, q, k, v):
        """softmax(q kᵀ/√D, causal over the whole sequence) v, for this rank's q, k, v (B, H, T/cp, D)."""
        return _Attend.apply(q, k, v, self)

    # -- the keys and values of each ring step --------------------------------------------------
    def _stream(self, kv):
        """Yields (step, source rank, its keys and values) for each of the cp steps."""
        n, r = self.n, self.r
        if self.impl == "allgather":
            every = torch.empty((n, *kv.shape), dtype=kv.dtype, device=kv.device)
            self.comm.all_gather(every.view(-1), kv.reshape(-1), self.group).wait()
            for s in range(n):
                yield s, (r - s) % n, every[(r - s) % n]
            return
        for s in range(n):
            handle = None
            if s < n - 1:
                nxt = torch.empty_like(kv)
                handle = self.comm.send_recv(kv, nxt, (r + 1) % n, (r - 1) % n, self.group, direct=True)
            begun = time.time()
            yield s, (r - s) % n, kv
            if handle is not None:  # (its flight record's launch, the step's attention begun, and done)
                self.events.append((handle.rec.t_start, begun, time.time()))
                handle.wait()
                kv = nxt

    def forward(self, q, k, v):
        c, scale = q.shape[2] // 2, 1 / math.sqrt(q.shape[-1])
        flash = _flash(q, self.exact)
        qf = q if flash else q.float()
        acc: list = [None, None]
        H = q.shape[1]
        for _s, src, kv in self._stream(torch.stack([k, v])):
            for a, b, diag in block_pairs(self.n, self.r, src, self.order):
                qa = qf[:, :, a * c:(a + 1) * c]
                ka, va = (repeat_kv(t[:, :, b * c:(b + 1) * c], H) for t in (kv[0], kv[1]))
                if flash:
                    ob, lb = _flash_pair(qa, ka, va, diag, scale)
                else:
                    ob, lb = _pair(qa, ka.float(), va.float(), diag, scale)
                self.pairs += 1
                if acc[a] is None:
                    acc[a] = (ob, lb)
                else:
                    o, lse = acc[a]
                    new = torch.logaddexp(lse, lb)
                    acc[a] = (o * torch.exp(lse - new).unsqueeze(-1) + ob * torch.exp(lb - new).unsqueeze(-1), new)
        return torch.cat([acc[0][0], acc[1][0]], 2), torch.cat([acc[0][1], acc[1][1]], 2)

    def backward(self, q, k, v, o, lse, do):
        n, r, H, Hkv = self.n, self.r, q.shape[1], k.shape[1]
        c, scale = q.shape[2] // 2, 1 / math.sqrt(q.shape[-1])
        flash = _flash(q, self.exact)
        qf, dof = (q, do.to(q.dtype)) if flash else (q.float(), do.float())
        delta = None if flash else (dof * o).sum(-1)
        of = o.to(q.dtype) if flash else None
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        ring = self.impl == "ring"
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device) if ring else \
            torch.zeros((n, *kv.shape), dtype=torch.float32, device=kv.device)
        for _s, src, held in self._stream(kv):
            mine = dkv if ring else dkv[src]
            for a, b, diag in block_pairs(n, r, src, self.order):
                qa, rows = slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c)
                ka, va = (repeat_kv(t[:, :, rows], H) for t in (held[0], held[1]))
                if flash:
                    dqa, dk, dv = _flash_pair_backward(qf[:, :, qa], ka, va, of[:, :, qa], lse[:, :, qa], dof[:, :, qa],
                                                       diag, scale)
                else:
                    dqa, dk, dv = _pair_backward(qf[:, :, qa], ka.float(), va.float(), dof[:, :, qa], lse[:, :, qa],
                                                 delta[:, :, qa], diag, scale)
                dq[:, :, qa] += dqa
                mine[0, :, :, rows] += fold_kv(dk, Hkv)
                mine[1, :, :, rows] += fold_kv(dv, Hkv)
            if ring and n > 1:  # on to the next holder of these keys and values; after cp steps, home
                back = torch.empty_like(dkv)
                self.comm.send_recv(dkv, back, (r + 1) % n, (r - 1) % n, self.group, direct=True).wait()
                dkv = back
        if not ring:
            out = torch.empty(kv.shape, dtype=torch.float32, device=kv.device)
            if self.exact:
                scratch = torch.empty_like(dkv)
                self.comm.exact_reduce_scatter(out.view(-1), dkv.view(-1), scratch.view(-1), self.group).wait()
            else:
                self.comm.reduce_scatter(out.view(-1), dkv.view(-1), self.group).wait()
            dkv = out
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def fold_kv(g, heads: int):
    """The gradient (B, H, c, D) of keys or values repeat_kv made H heads of, summed back to `heads`:
    over each key/value head's H/heads query heads, in order (a fixed-order sum)."""
    B, H, c, D = g.shape
    return g if H == heads else g.view(B, heads, H // heads, c, D).sum(2)


SCORES = 1 << 22  # elements of one tile's scores per (batch, head): query rows x key chunk


def tile_rows(c: int) -> int:
    """Query rows a tile of a c x c block pair: the scores (and their gradients) exist for one
    tile at a time, rows x c fp32 per (batch, head). A function of c alone, so the bits are too."""
    return max(1, min(c, SCORES // c))


def _scores(q, k, rows: slice, diag: bool, scale: float):
    s = torch.matmul(q[:, :, rows], k.transpose(-1, -2)) * scale
    if diag:  # query row i (of the chunk) sees keys 0..i
        i = torch.arange(rows.start, rows.stop, device=s.device)[:, None]
        s = s.masked_fill(torch.arange(k.shape[2], device=s.device)[None, :] > i, float("-inf"))
    return s


def _pair(q, k, v, diag: bool, scale: float):
    """One block pair (fp32), tile by tile of query rows: its attention output and each row's
    log-sum-exp."""
    c, t = q.shape[2], tile_rows(q.shape[2])
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=q.dtype, device=q.device)
    for a in range(0, c, t):
        rows = slice(a, min(a + t, c))
        s = _scores(q, k, rows, diag, scale)
        lse[:, :, rows] = torch.logsumexp(s, -1)
        o[:, :, rows] = torch.matmul(torch.exp(s - lse[:, :, rows].unsqueeze(-1)), v)
    return o, lse


def _pair_backward(q, k, v, do, lse, delta, diag: bool, scale: float):
    """One block pair's share of dq, dk, dv (fp32), its probabilities from the merged lse; tile by
    tile of query rows, dk and dv summed over the tiles in order."""
    c, t = q.shape[2], tile_rows(q.shape[2])
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a in range(0, c, t):
        rows = slice(a, min(a + t, c))
        p = torch.exp(_scores(q, k, rows, diag, scale) - lse[:, :, rows].unsqueeze(-1))
        dv += torch.matmul(p.transpose(-1, -2), do[:, :, rows])
        ds = p * (torch.matmul(do[:, :, rows], v.transpose(-1, -2)) - delta[:, :, rows].unsqueeze(-1))
        dq[:, :, rows] = torch.matmul(ds, k) * scale
        dk += torch.matmul(ds.transpose(-1, -2), q[:, :, rows]) * scale
    return dq, dk, dv


def _flash(q, exact: bool) -> bool:
    """Whether block pairs run on torch's flash kernels: on CUDA in half precision, outside exact
    mode (flash's backward adds dq in whatever order its blocks finish)."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and not exact
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 and torch.cuda.get_device_capability(q.device)[0] >= 8)


def _flash_pair(q, k, v, diag: bool, scale: float):
    """One block pair on torch's flash attention: the output (as fp32, for the merge) and the
    log-sum-exp it returns (fp32)."""
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, diag, False, scale=scale)
    return out[0].float(), out[1][..., :q.shape[2]]


def _flash_pair_backward(q, k, v, o, lse, do, diag: bool, scale: float):
    """One block pair's share of dq, dk, dv on flash's backward, its probabilities from the merged
    output and lse (so that its delta is the whole row's)."""
    c = q.shape[2]  # (no sequence offsets, no dropout: None for their tensors)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, o, lse.contiguous(), None, None, c, c, 0.0, diag, None, None, scale=scale)
    return dq.float(), dk.float(), dv.float()


class _Attend(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cx):
        with torch.autocast(q.device.type, enabled=False):
            o, lse = cx.forward(q, k, v)
        ctx.cx = cx
        ctx.save_for_backward(q, k, v, o, lse)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            dq, dk, dv = ctx.cx.backward(q, k, v, o, lse, do)
        return dq, dk, dv, None
