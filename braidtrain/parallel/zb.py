"""Zero bubble's split backward (Qi et al. 2023): a chunk's backward as B, the gradient of its
input -- what the previous stage waits for -- and W, its weights' gradients, run later in the
bubble.

Both halves are autograd's own nodes on the graph the forward built, so W's gradients are
bitwise those of the unsplit backward. B asks autograd for the input's gradient alone
(retaining the graph): a node on the way to the input then computes only its outputs that lead
there. The nodes on that way whose other edges lead to parameters ("split nodes": a matmul whose
other operand is a weight, a LayerNorm) have their incoming gradient captured as B passes them.
W starts autograd again at each of those nodes with its captured gradient and, as the only
inputs, the parameters below its edges that B did not take, so each split node now computes
just the outputs B skipped (not its way to the input again), and each weight subgraph runs once.

    out ---- ... ---- MmBackward ---- (to the input)         B: this way, capturing MmBackward's
                          \\                                     incoming gradient
                           TBackward -- AccumulateGrad(W)   W: MmBackward again, for W only

It needs the chunk's whole backward graph at B: activation recomputation (which builds it
during the backward) and torch.compile (one fused backward node) cannot be split; layout.py
refuses those with zb.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


def backward_input(outputs: torch.Tensor, grad, inp: torch.Tensor):
    """B: returns the gradient of `inp` and what W needs: the captured split nodes' gradients,
    and `outputs`, whose graph they are (on torch 2.11 a GradientEdge does not keep a Python
    Function's node -- the head's loss -- alive; only the tensors and nodes above it do)."""
    target = get_gradient_edge(inp).node
    reaches, order = {}, []

    def reaches_input(node) -> bool:  # (iterative: a deep graph would exhaust Python's stack)
        stack = [node]
        while stack:
            n = stack[-1]
            if n in reaches:
                stack.pop()
                continue
            children = [c for c, _ in n.next_functions if c is not None and c not in reaches]
            if children:
                stack.extend(children)
                continue
            stack.pop()
            reaches[n] = n is target or any(reaches.get(c, False) for c, _ in n.next_functions if c is not None)
            order.append(n)
        return reaches[node]

    root = outputs.grad_fn
    reaches_input(root)
    split = [n for n in order if reaches[n] and any(c is not None and not reaches[c] for c, _ in n.next_functions)]
    captured, hooks = {}, []
    for n in split:
        hooks.append(n.register_prehook(lambda grads, n=n: captured.__setitem__(n, grads)))
    try:
        (dinp,) = torch.autograd.grad(outputs, inp, grad, retain_graph=True)
    finally:
        for h in hooks:
            h.remove()
    weights = []  # per split node: (its edges, their gradients, the parameters below its other edges)
    for n in split:
        grads = captured.get(n, ())
        edges = [(GradientEdge(n, i), g) for i, g in enumerate(grads) if g is not None]
        params = _leaves([c for c, _ in n.next_functions if c is not None and not reaches[c]])
        if edges and params:
            weights.append(([e for e, _ in edges], [g for _, g in edges], params))
    return dinp, (outputs, weights)


def backward_weight(pending) -> None:
    """W: the parameters' gradients, accumulated into their .grad as autograd does (their
    post-accumulate hooks -- the engine's -- run)."""
    _outputs, weights = pending
    for edges, grads, params in weights:
        torch.autograd.backward(edges, grads, inputs=params)


def _leaves(nodes) -> list[torch.Tensor]:
    """The parameters (leaves requiring grad) below these nodes."""
    out, seen, stack = [], set(), list(nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if hasattr(n, "variable"):  # an AccumulateGrad
            out.append(n.variable)
        stack.extend(c for c, _ in n.next_functions if c is not None)
    return out
