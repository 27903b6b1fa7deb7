"""A lean state's fp32 masters (parallel/buckets.py's docstring): where a bucket's compute weights
are bf16, the fp32 master of what this rank owns is a tensor of its own -- the optimizer updates it,
and publish() writes it to the compute weights (rounded to nearest even, as autocast's cast of an
fp32 weight rounds). Elsewhere the bucket is its own master (`b.master` a view of `b.data`).

    bucket (padded):     [ shard 0 | shard 1 | ... | shard n-1 ]   compute weights, b.dtype
    rank r's master:                 [ fp32  ]                      ZeRO 1-3: its shard; ZeRO-0: all
"""

from __future__ import annotations

import torch


def lay_out(b, device) -> None:
    """The parameters' (fp32) values into bucket b: its compute buffer and, kept apart, its master
    where this rank owns it -- from the fp32 values, never from the rounded compute weights."""
    master = torch.zeros(b.padded, device=device) if b.apart else b.full  # fp32, the whole bucket
    for p, view in b.views(master):
        view.copy_(p.detach())
    if b.apart:
        b.full.copy_(master)
        lo, hi = b.owned_range()
        b.master = master if (lo, hi) == (0, b.padded) else master[lo:hi].clone()


def publish(buckets) -> None:
    """After the optimizer's update of the masters: the compute weights of what this rank owns follow."""
    for b in buckets:
        if b.apart:
            b.compute_shard().copy_(b.master)


def whole(b, comm, device) -> torch.Tensor:
    """Bucket b's whole fp32 master, on the device (collective over its group where it is sharded;
    an fp32 bucket's is its compute buffer itself: under ZeRO-3, call inside Engine.gathered())."""
    if not b.apart:
        return b.full
    lo, hi = b.owned_range()
    if (lo, hi) == (0, b.padded):
        return b.master.to(device)
    out = torch.empty(b.padded, device=device)
    comm.all_gather(out, b.master.to(device), b.group).wait()
    return out


def state_bytes(buckets) -> int:
    """Bytes of compute weights, fp32 masters kept apart on the device, and gradients held in these
    buckets (now)."""
    n = 0
    for b in buckets:
        n += b.data.nbytes + (b.full.untyped_storage().nbytes() if b.zero == 3 else 0)
        n += b.master.nbytes if b.apart and not b.hosted else 0  # (on the CPU the host is the device)
        n += (b.grad.nbytes if b.grad is not None else 0) + (b.shard_grad.nbytes if b.zero >= 2 else 0)
    return n
