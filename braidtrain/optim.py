"""AdamW over flat shards, the learning-rate schedule, and gradient clipping.

The optimizer never sees a parameter: it sees the (fp32 master shard, gradient shard) pairs the
data-parallel engine says this rank owns -- whole buckets under ZeRO-0, one shard of each bucket
under ZeRO-1 -- and keeps m and v for exactly those elements (in a bf16 run's lean state the master
is apart from the bf16 compute weights, which follow it after each update: parallel/buckets.py).
On the CPU (and the host under --offload) the update is torch's fused AdamW kernel
(`torch._fused_adamw_`), one multi-tensor launch over the whole owned shards, after decoupled
weight decay on the ranges that hold 2-D weights (one `_foreach_mul_`), and then the engine's
publish() writes a lean bucket's compute weights from its master (`copy_`, to nearest even).
Every operation is elementwise, so the update of an element does not depend on where the shard
boundaries fall -- provided each element takes the same code path: torch's CPU kernel treats the
last len % SIMD-width elements of each tensor with scalar code, which rounds differently, so the
kernel is given whole shards only (multiples of 64 elements, 64-aligned: no scalar tail), never
parameter-sized pieces (checked bitwise in default mode by test_engine.py's
test_adamw_bits_do_not_depend_on_shard_or_parameter_boundaries, at an n_embd that is not a multiple
of 16). The host's update under --offload takes the decay inside the kernel instead (apply's
decay_in_kernel: two launches, the decayed ranges and the rest, cut at the 2-D weights' edges): a
pass over host memory less, for scalar tails at those edges -- its bits may then depend on the
layout, within default mode's tolerance; exact mode never takes that path.

On a GPU, either mode runs all three as one Triton kernel a shard (`one_pass`:
parallel/exact_kernels.py's adamw): the decay on the decayed ranges (a table of the ranges each
block meets, made once a shard: `decay_table`), AdamW, and where the bucket is lean its bf16
compute weights written from the new master in the same pass -- 30 bytes an element where the
three launches move up to 46 (the decay's 8 on a 2-D weight's, fused AdamW's 32 with g /
grad_scale written back into g, publish's 6; issue #58: 11.8 ms of a Llama-3.2-1B step on an
H200, against 8.0 for 28 bytes at 4.3 TB/s; benchmarks/kernels/adamw_gpu.py times both). Its
operations are exact mode's (below), each rounded once: its bits differ from torch's fused
kernel's within default mode's tolerance (tests/test_one_pass_adamw.py: 1e-6 relative, the bf16
weights within an ulp), and every element takes the same operations wherever the blocks and
shards cut, so they do not depend on the layout either. The gradient is left as it was (torch's
kernel writes g / grad_scale into it; nothing reads it after the update). Exact mode takes the
same kernel: its bits are exact mode's torch path's (the decay, exact_adamw, copy_ -- bit for bit,
interpreted in the test and over 1.24 G elements on an H200), so the host's update under --offload
(that torch path) still gives a GPU's bits.

Gradient clipping divides the gradient inside the same kernel (`grad_scale`), with the scale
computed on the device: the step needs no host synchronisation. The learning rate, the decay
factor, the step count and the bias corrections are device scalars too, written by `prepare`
before the step's GPU work: `update` launches the same kernels with the same arguments every step,
so --cuda-graph can capture it once and replay it.

Exact mode writes the update as single elementwise operations instead (exact_adamw): each one
IEEE-rounded, in its own kernel, so no multiply-add is contracted into one rounding -- the CPU's
and the GPU's fused kernels differ there -- and the bias corrections computed once on the host in
float64; the square root in float64, rounded once (torch's float32 sqrt is correctly rounded on
CUDA, not on the CPU). The same operations then give the same bits on the GPU and on the host, which is what
--offload optimizer (parallel/offload.py: the update on the host) needs to keep exact mode's
promise. Default mode keeps torch's fused kernel on the CPU. On a GPU both modes take the one
kernel above, whose operations are these, with the same bits (parallel/exact_kernels.py).
"""

from __future__ import annotations

import math

import torch

from braidtrain.parallel import exact_kernels


def lr_at(step: int, *, lr: float, warmup: int, max_steps: int, final_frac: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to lr * final_frac at max_steps."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if max_steps <= warmup:
        return lr
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return lr * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


class AdamW:
    """`offload`: m and v (and an fp32 master of the owned shards) in host memory, updated there
    (--offload optimizer: parallel/offload.py) -- all but the buckets `ratio` (--offload-ratio: the
    share of the owned elements hosted) keeps on the device, updated here as without offload."""

    def __init__(self, engine, *, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, offload=False, ratio=1.0):
        self.engine, self.exact = engine, engine.exact
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.step_count = 0
        host = torch.device("cpu") if offload else engine.device
        on_device = []  # --offload-ratio: the owned buckets whose state stays on the device (offload.kept)
        if offload:
            from braidtrain.parallel import offload as hosting

            on_device = hosting.kept(engine, ratio)
        self.groups = []  # (m, v, ranges of 2-D weights), one per owned shard
        for i, (b, p, _) in enumerate(engine.owned()):
            home = engine.device if i in on_device else host
            self.groups.append((torch.zeros(p.numel(), device=home), torch.zeros(p.numel(), device=home),
                                engine.decay_segments(b)))
        # the step's scalars (step, lr, 1 - lr * weight_decay, lr / (1 - beta1^t), 1 / sqrt(1 - beta2^t)),
        # on the device, and on the host for an offloaded update
        self.scalars = {place.type: tuple(torch.zeros((), dtype=torch.float32, device=place) for _ in range(5))
                        for place in (engine.device, host)}
        self.decay_tables = {}  # (device, shard length, decay ranges) -> the one kernel's (decay_table())
        self.offload = hosting.Offload(engine, self, on_device) if offload else None

    def state_numel(self) -> int:
        """Elements of m (equally of v) held by this rank."""
        return sum(m.numel() for m, _, _ in self.groups)

    def step(self, lr: float, grad_scale: torch.Tensor | None = None) -> None:
        """One update; the gradients are divided by grad_scale (a float32 scalar tensor) first."""
        self.prepare(lr)
        self.update(grad_scale)

    def prepare(self, lr: float) -> None:
        """The host's part of a step: count it and set its learning rate (outside any graph)."""
        self.step_count += 1
        t = self.step_count
        values = (t, lr, 1 - lr * self.weight_decay, lr / (1 - self.beta1**t), 1 / math.sqrt(1 - self.beta2**t))
        for scalars in self.scalars.values():
            for s, x in zip(scalars, values):
                s.fill_(x)

    def wait(self) -> None:
        """The last update has landed on every weight and moment (--offload optimizer: the host's
        runs into the next step, parallel/offload.py); call it before reading them between steps."""
        if self.offload is not None:
            self.offload.wait()

    def loaded(self) -> None:
        """The owned weights were written from a checkpoint: an offloaded master follows them."""
        if self.offload is not None:
            self.offload.refresh()

    @torch.no_grad()
    def update(self, grad_scale: torch.Tensor | None = None, skip: torch.Tensor | None = None) -> None:
        """The GPU's part: decay, then AdamW, on what this rank owns -- none of it where `skip` (a
        float device tensor, 1 for a step whose gradient norm is not finite: the same on every
        rank, the norm being global) says so, without the host waiting to know."""
        # the gradient shards are fetched each step: in exact mode they are fresh tree buffers
        owned, groups = list(self.engine.owned()), self.groups
        if self.offload is not None:  # streamed to the host, updated there, streamed back meanwhile;
            self.offload.step(grad_scale, skip)  # the kept buckets here, as without offload
            owned, groups = [owned[i] for i in self.offload.kept], [groups[i] for i in self.offload.kept]
            if not owned:
                return
        # a lean state's compute weights follow their fp32 masters: written in the update's own pass
        # where it is one kernel (CUDA), else by the engine's publish() after it
        one_pass = self.one_pass(owned[0][1])
        compute = [b.compute_shard() if one_pass and b.apart else None for b, _, _ in owned]
        self.apply([p for _, p, _ in owned], [g for _, _, g in owned], groups, grad_scale, skip, compute=compute)
        self.engine.publish([b for (b, _, _), out in zip(owned, compute) if out is None])

    def one_pass(self, t: torch.Tensor) -> bool:
        """Whether apply updates shards like t in one kernel a shard (exact_kernels.adamw): on a GPU,
        with triton, in either mode (its bits are exact mode's torch path's: module docstring)."""
        return exact_kernels.usable(t)

    @torch.no_grad()
    def apply(self, params, grads, groups, grad_scale=None, skip=None, scalars=None, decay_in_kernel=False,
              compute=None) -> None:
        """update()'s kernels on these shards (groups: their (m, v, decay ranges)) with this step's
        scalars (or `scalars`, a copy of them), on the device where the shards are (the host's under
        --offload) -- also how live recovery's buddy copy follows its neighbour's shard
        (parallel/mirror.py): the same kernels, arguments and shard lengths give the same bits.
        `decay_in_kernel` (default mode; the host's update under --offload): the decay inside the
        fused kernel, over the decayed ranges and the rest apart, not a pass of its own over the
        weights (a fifth of the host update's time) -- other roundings (p - lr*wd*p), and scalar tails
        where a range ends off the vector width. `compute` (only where one_pass): per shard, the bf16
        compute weights the one kernel writes from the new p, or None."""
        step, lr, keep, c1, c2 = scalars or self.scalars[params[0].device.type]
        if self.one_pass(params[0]):  # decay, AdamW and the compute weights: one kernel a shard
            for p, g, (m, v, decay), out in zip(params, grads, groups, compute or [None] * len(params)):
                exact_kernels.adamw(p, g, m, v, self.decay_table(p, decay), out, keep, c1, c2, self.beta1, self.beta2,
                                    self.eps, grad_scale, skip)
            return
        if decay_in_kernel and self.weight_decay and not self.exact:
            by_wd = {self.weight_decay: ([], [], [], []), 0.0: ([], [], [], [])}
            for p, g, (m, v, decay) in zip(params, grads, groups):
                for a, e, decayed in spans(decay, p.numel()):
                    for out, t in zip(by_wd[self.weight_decay if decayed else 0.0], (p, g, m, v)):
                        out.append(t[a:e])
            for wd, (ps, gs, ms, vs) in by_wd.items():
                if ps:
                    torch._fused_adamw_(ps, gs, ms, vs, [], [step] * len(ps), lr=lr, beta1=self.beta1,
                                        beta2=self.beta2, weight_decay=wd, eps=self.eps, amsgrad=False,
                                        maximize=False, grad_scale=grad_scale, found_inf=skip)
            return
        if self.weight_decay:  # decoupled: p *= 1 - lr * wd on 2-D weights, before the update
            decayed = [p[a:e] for p, (_, _, decay) in zip(params, groups) for a, e in decay]
            if decayed:
                torch._foreach_mul_(decayed, keep if skip is None else torch.where(skip > 0, 1.0, keep))
        if self.exact:  # (off a GPU: the host's update, the CPU)
            for p, g, (m, v, _) in zip(params, grads, groups):
                exact_adamw(p, g, m, v, self.beta1, self.beta2, self.eps, c1, c2, grad_scale, skip)
            return
        torch._fused_adamw_(params, grads, [m for m, _, _ in groups], [v for _, v, _ in groups], [],
                            [step] * len(params), lr=lr, beta1=self.beta1, beta2=self.beta2,
                            weight_decay=0.0, eps=self.eps, amsgrad=False, maximize=False, grad_scale=grad_scale,
                            found_inf=skip)


    def decay_table(self, p: torch.Tensor, decay) -> tuple[torch.Tensor, torch.Tensor]:
        """The one kernel's table of shard p's decay ranges (exact_kernels.decay_table), made on the
        first step (eager, before any --cuda-graph capture) and kept."""
        key = (p.device, p.numel(), tuple(decay) if self.weight_decay else ())
        if key not in self.decay_tables:
            self.decay_tables[key] = exact_kernels.decay_table(key[2], p.numel(), p.device)
        return self.decay_tables[key]


def spans(decay, n: int) -> list[tuple[int, int, bool]]:
    """[0, n) cut at the sorted, disjoint decay ranges: (start, end, decayed) in order."""
    out, at = [], 0
    for a, e in decay:
        if at < a:
            out.append((at, a, False))
        out.append((a, e, True))
        at = e
    if at < n:
        out.append((at, n, False))
    return out


def exact_adamw(p, g, m, v, beta1, beta2, eps, c1, c2, grad_scale=None, skip=None) -> None:
    """AdamW's update of p (its moments m, v) by gradient g, one IEEE operation a kernel: the same
    bits on any device (module docstring). c1 = lr / (1 - beta1^t), c2 = 1 / sqrt(1 - beta2^t),
    0-dim tensors on p's device; the gradient is multiplied by 1 / grad_scale (a reciprocal, then
    products: a division by a scalar may be turned into a product by one kernel and not another)."""
    if grad_scale is not None:
        g = g * torch.reciprocal(grad_scale)
    m_new = m * beta1 + g * (1 - beta1)
    v_new = v * beta2 + (g * g) * (1 - beta2)
    # sqrt in float64, rounded once to float32: correctly rounded on every device. torch's float32 sqrt
    # on the CPU is not (on the H200 machine's host 27,281 of 4M values differ from CUDA's, which is; on
    # the 2-core VM 826,183 of 4M from numpy's) -- the one operation that broke --exact --offload on a GPU
    p_new = p - (m_new * c1) / (torch.sqrt(v_new.double()).float() * c2 + eps)
    if skip is not None:  # a non-finite step changes nothing (decided on the device: no host wait)
        keep = skip > 0
        m_new, v_new, p_new = torch.where(keep, m, m_new), torch.where(keep, v, v_new), torch.where(keep, p, p_new)
    m.copy_(m_new)
    v.copy_(v_new)
    p.copy_(p_new)


def clip_scale(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """What to divide the gradient by to bring its global norm down to max_norm: norm / max_norm
    when above (1 when below, or when the norm is not finite); None when clipping is off.
    A device tensor: computing it does not wait for the GPU."""
    if max_norm <= 0:
        return None
    over = torch.isfinite(norm) & (norm > max_norm)
    return torch.where(over, (norm + 1e-6) / max_norm, torch.ones_like(norm)).float()
