"""The Triton kernels of attention.py's deterministic causal attention (its docstring has the
algorithm): the forward, the delta, dK/dV and dQ passes, and `load`, which imports triton and jits
them on first use -- so that attention.py, and the modules importing it, import without triton."""

from __future__ import annotations  # kernel annotations stay strings until triton is imported

import os

triton = tl = None  # bound by load(); the kernels below resolve `tl` through this module


# ---- kernels -------------------------------------------------------------------------------
# Plain functions here; load() replaces each with triton.jit(fn) in this module's
# namespace, which is also where the kernels find `tl` and each other. Pointers Q, K, ... are
# (B, H, T, D) with the given (b, h, t) strides and unit d stride; L and Δ are (B·H, T).
# Grids are 1-D, (blocks per head) × B·H, a head's blocks adjacent.

def _program(T, BLK: tl.constexpr, H, LAST_FIRST: tl.constexpr):
    """This program's head bh = b·H + h, its block of BLK rows (of T), and b and h (int64): the
    grid's last block of a head first when LAST_FIRST."""
    n_blk = tl.cdiv(T, BLK)
    pid = tl.program_id(0)
    bh = pid // n_blk
    if LAST_FIRST:
        blk = n_blk - 1 - pid % n_blk
    else:
        blk = pid % n_blk
    return bh, blk, (bh // H).to(tl.int64), (bh % H).to(tl.int64)


def _fwd_kernel(Q, K, V, O, L, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                H, T, qk_scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    qk_scale = tl.cast(qk_scale, tl.float32)  # (fp32 from Triton's launcher; fp64 from torch.compile's)
    bh, blk, b, h = _program(T, BM, H, True)  # last (longest) query block first: a shorter tail
    Q += b * sqb + h * sqh
    K += b * skb + h * skh
    V += b * svb + h * svh
    O += b * sob + h * soh
    L += bh.to(tl.int64) * T

    start_m = blk * BM
    offs_m = start_m + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + offs_m[:, None] * sqt + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)
    m_i = tl.full([BM], float("-inf"), tl.float32)  # running row max of the scaled scores
    l_i = tl.zeros([BM], tl.float32)                 # running row sum of exp2(score - m_i)
    acc = tl.zeros([BM, D], tl.float32)
    # Key blocks wholly below the diagonal (every key < start_m <= every query), unmasked ...
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, skt, svt, 0, start_m, T, qk_scale, offs_m,
                               D, BN, False, PREC)
    # ... then the diagonal blocks, causally masked (which also hides keys >= T from real rows).
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, skt, svt, start_m, tl.minimum(start_m + BM, T), T,
                               qk_scale, offs_m, D, BN, True, PREC)
    acc = acc / l_i[:, None]
    tl.store(O + offs_m[:, None] * sot + offs_d[None, :], acc.to(O.dtype.element_ty), mask=offs_m[:, None] < T)
    tl.store(L + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < T)


def _fwd_inner(acc, l_i, m_i, q, K, V, skt, svt, lo, hi, T, qk_scale, offs_m,
               D: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        if CAUSAL:
            kT = tl.load(K + offs_n[None, :] * skt + offs_d[:, None], mask=offs_n[None, :] < T, other=0.0)
            v = tl.load(V + offs_n[:, None] * svt + offs_d[None, :], mask=offs_n[:, None] < T, other=0.0)
        else:
            kT = tl.load(K + offs_n[None, :] * skt + offs_d[:, None])
            v = tl.load(V + offs_n[:, None] * svt + offs_d[None, :])
        s = tl.dot(q, kT, input_precision=PREC) * qk_scale
        if CAUSAL:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: key start_m is visible to every row here
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


def _delta_kernel(O, DO, Delta, sob, soh, sot, sdb, sdh, sdt, H, T, D: tl.constexpr, BM: tl.constexpr):
    bh, blk, b, h = _program(T, BM, H, False)
    offs_m = blk * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    rows = offs_m[:, None] < T
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :], mask=rows, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :], mask=rows, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + bh.to(tl.int64) * T + offs_m, delta, mask=offs_m < T)


def _dkdv_kernel(Q, K, V, DO, L, Delta, DK, DV,
                 sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt, skb2, skh2, skt2, svb2, svh2, svt2,
                 H, T, qk_scale, sm_scale,
                 D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    qk_scale, sm_scale = tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32)  # (as in _fwd_kernel)
    bh, blk, b, h = _program(T, BN, H, False)  # first key block (sees every query) first
    Q += b * sqb + h * sqh
    DO += b * sdb + h * sdh
    L += bh.to(tl.int64) * T
    Delta += bh.to(tl.int64) * T

    start_n = blk * BN
    offs_n = start_n + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    cols = offs_n[:, None] < T
    k = tl.load(K + b * skb + h * skh + offs_n[:, None] * skt + offs_d[None, :], mask=cols, other=0.0)
    v = tl.load(V + b * svb + h * svh + offs_n[:, None] * svt + offs_d[None, :], mask=cols, other=0.0)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    # Query blocks on the diagonal (masked), then those wholly below it, in increasing order.
    dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, L, Delta, sqt, sdt, start_n, tl.minimum(start_n + BN, T), T,
                         qk_scale, offs_n, D, BM, True, PREC)
    dk, dv = _dkdv_inner(dk, dv, k, v, Q, DO, L, Delta, sqt, sdt, start_n + BN, T, T,
                         qk_scale, offs_n, D, BM, False, PREC)
    dk *= sm_scale
    tl.store(DK + b * skb2 + h * skh2 + offs_n[:, None] * skt2 + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=cols)
    tl.store(DV + b * svb2 + h * svh2 + offs_n[:, None] * svt2 + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=cols)


def _dkdv_inner(dk, dv, k, v, Q, DO, L, Delta, sqt, sdt, lo, hi, T, qk_scale, offs_n,
                D: tl.constexpr, BM: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    # Works on transposed tiles (keys × queries) so the per-key sums are row sums. Query rows
    # >= T load as zeros (q = dO = L = Δ = 0): their Pᵀ is 1 but dO = 0, so they add nothing.
    offs_d = tl.arange(0, D)
    for start_m in range(lo, hi, BM):
        offs_m = start_m + tl.arange(0, BM)
        qT = tl.load(Q + offs_m[None, :] * sqt + offs_d[:, None], mask=offs_m[None, :] < T, other=0.0)
        do = tl.load(DO + offs_m[:, None] * sdt + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)
        lse = tl.load(L + offs_m, mask=offs_m < T, other=0.0)
        delta = tl.load(Delta + offs_m, mask=offs_m < T, other=0.0)
        pT = tl.math.exp2(tl.dot(k, qT, input_precision=PREC) * qk_scale - lse[None, :])
        if CAUSAL:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do, input_precision=PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=PREC)
    return dk, dv


def _dq_kernel(Q, K, V, DO, L, Delta, DQ,
               sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt, sqb2, sqh2, sqt2,
               H, T, qk_scale, sm_scale,
               D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    qk_scale, sm_scale = tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32)  # (as in _fwd_kernel)
    bh, blk, b, h = _program(T, BM, H, True)  # last (longest) query block first
    K += b * skb + h * skh
    V += b * svb + h * svh

    start_m = blk * BM
    offs_m = start_m + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    rows = offs_m[:, None] < T
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :], mask=rows, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :], mask=rows, other=0.0)
    lse = tl.load(L + bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)
    delta = tl.load(Delta + bh.to(tl.int64) * T + offs_m, mask=offs_m < T, other=0.0)
    dq = tl.zeros([BM, D], tl.float32)
    # The diagonal key blocks (masked), then key blocks 0 … start_m - 1 in increasing order.
    dq = _dq_inner(dq, q, do, lse, delta, K, V, skt, svt, start_m, tl.minimum(start_m + BM, T), T,
                   qk_scale, offs_m, D, BN, True, PREC)
    dq = _dq_inner(dq, q, do, lse, delta, K, V, skt, svt, 0, start_m, T,
                   qk_scale, offs_m, D, BN, False, PREC)
    dq *= sm_scale
    tl.store(DQ + b * sqb2 + h * sqh2 + offs_m[:, None] * sqt2 + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=rows)


def _dq_inner(dq, q, do, lse, delta, K, V, skt, svt, lo, hi, T, qk_scale, offs_m,
              D: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr):
    offs_d = tl.arange(0, D)
    for start_n in range(lo, hi, BN):
        offs_n = start_n + tl.arange(0, BN)
        kT = tl.load(K + offs_n[None, :] * skt + offs_d[:, None], mask=offs_n[None, :] < T, other=0.0)
        vT = tl.load(V + offs_n[None, :] * svt + offs_d[:, None], mask=offs_n[None, :] < T, other=0.0)
        p = tl.math.exp2(tl.dot(q, kT, input_precision=PREC) * qk_scale - lse[:, None])
        if CAUSAL:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        dp = tl.dot(do, vT, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=PREC)
    return dq


_KERNELS = ("_program", "_fwd_kernel", "_fwd_inner", "_delta_kernel", "_dkdv_kernel", "_dkdv_inner", "_dq_kernel",
            "_dq_inner")


def load() -> None:
    """Import triton (ImportError if absent) and jit the kernels, once per process. Whether
    they compile for the GPU or run in the interpreter is fixed here, by TRITON_INTERPRET."""
    global triton, tl
    if triton is not None:
        return
    import triton as _triton
    import triton.language as _tl
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        fix_interpreter_index()
    g = globals()
    tl = _tl
    for name in _KERNELS:
        g[name] = _triton.jit(g[name])
    triton = _triton  # last: marks the kernels ready


def fix_interpreter_index() -> None:
    """Interpreter only. Triton 3.6's interpreter turns a scalar into a Python int (a `range`
    bound, such as our runtime loop limits) with int() of a shape-(1,) array, which NumPy
    >= 2.4 refuses (triton-lang/triton#9171). Re-apply upstream's fix (#9172: squeeze first);
    a no-op where the interpreter has no _patch_lang_tensor."""
    import triton.runtime.interpreter as interp
    original = getattr(interp, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_braidtrain_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._braidtrain_fixed = True
    interp._patch_lang_tensor = patched
