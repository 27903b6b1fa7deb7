"""ZeRO-2 and ZeRO-3's hooks around each block: gradient scratch opened as the backward reaches
a bucket, and (ZeRO-3) parameters gathered for the work that needs them and released after.

ZeRO-2/3 gradients. A block bucket's scratch opens when the backward reaches it (a hook on the
gradient of the bucket's output); a bucket of no block (the embedding group) opens at its first
gradient. The engine then hands it, complete, to the reduce-scatter.

ZeRO-3 parameters. A bucket's full buffer exists only while gathered: its storage is resized to
zero when released and back when gathered, so the parameters (views into it) and the tensors
autograd saved for backward stay valid objects. Block buckets are gathered by a forward pre-hook
(which also prefetches the next bucket) and released after their forward. The backward pass gathers
a bucket again only if it reads it: while a block runs forward, a saved-tensor hook looks at what
autograd keeps for its backward -- a 1-D parameter (a LayerNorm's weight, a bias) is kept as a
copy; a weight itself (fp32 compute, or a lean state's bf16 bucket) marks the bucket, and a hook on
the bucket's output gathers it again for the backward (and prefetches the previous one). Where other
code's saved-tensor hooks are active (--recompute's checkpoint, whose backward runs the block's
forward again; save_on_cpu) every block is marked. Buckets are released once a backward's gradients
are reduced. Under bf16 autocast over fp32 buckets the backward needs only the bf16 copies of the
weights that the forward saved, so a step gathers each block once a micro-step, not twice -- but
those copies live from the forward to the backward; a lean state (buckets.py) gathers its bf16
buckets again instead: half the bytes of an fp32 gather, and nothing kept between. (A block that
checkpoints part of itself would recompute that part from released parameters -- an error, not
wrong numbers; --recompute checkpoints whole blocks.)

Kept between micro-batches. The parameters do not change within a step, so the embedding group
(wte, tied to the head, wpe, ln_f; used at both ends of the model, so gathered for nearly all of
every micro-batch anyway) stays gathered from the step's first forward to the gradients of its
last backward. The first block, released after its forward, is gathered again as a backward
reaches the block after it, the activations mostly freed by then, and kept for the next forward,
which then starts with nothing to wait for. (If all blocks are one bucket, there is no block after
it: it is gathered at the forward's start.) After the last backward the optimizer changes the
parameters: both are released, and gathered afresh. Whatever the order of forwards and backwards
(1F1B runs forward k+1 before backward k), a bucket is gathered whenever a forward or a backward
of any in-flight micro-batch needs it, so each of them finds it there.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch


class Zero:
    def __init__(self, engine):
        self.e = engine
        mine = [b for b in engine.buckets if b.zero >= 2]  # (a reduce group of one rank runs ZeRO-0's: buckets.py)
        self.zero3 = [b for b in mine if b.zero == 3]
        # block buckets in backward order (last block first), a chain per reduce group (a block of
        # experts is in two: its dense and its expert parameters), each its own prefetch order
        # (a lean state's 1-D parameters' buckets run ZeRO-2's beside ZeRO-3's matrices: a chain of their own)
        self.chains = [[b for b in mine if b.modules and (b.group, b.zero) == key]
                       for key in dict.fromkeys((b.group, b.zero) for b in mine if b.modules)]
        self.embed = [b for b in mine if not b.modules]
        self.kept = [b for b in self.embed + [c[-1] for c in self.chains] if b.zero == 3]
        self.keep_gathered = False  # inside gathered(): nothing is released
        self._watch = None  # the saved-tensor hooks of the block running forward
        self._watched: list = []  # its buckets (a block of experts has two: dense and expert parameters)
        with torch.no_grad():
            for b in self.zero3:
                b.data.copy_(b.full[b.lo : b.hi])
                self._release(b)
        self._install()
        for b in self.embed:  # buckets of no block: opened by the first of their gradients
            for _, p in b.params:
                p.register_hook(partial(self._open_on_first_grad, b))

    # -- what the engine calls -----------------------------------------------------------------
    def before_forward(self):
        for b in self.embed:  # needed first and last
            if b.zero == 3:
                self._gather(b)
        for chain in self.chains:
            if chain[-1].zero == 3:
                self._gather(chain[-1], wait=False)  # prefetch the first block

    def gradients_done(self, b):
        """A backward's gradients of bucket b are all in (and their reduction launched)."""
        if b.zero == 3 and (self.e.last or b not in self.kept):
            self._release(b)

    @contextmanager
    def gathered(self):
        for b in self.zero3:
            self._gather(b)
        self.keep_gathered = True
        try:
            yield
        finally:
            self.keep_gathered = False
            for b in self.zero3:
                self._release(b)

    # -- gathering -------------------------------------------------------------------------------
    def _gather(self, b, wait=True):
        if self.e.updates is not None and not self.e.updates.ready(b, block=wait):
            return  # --offload: the shard's update is in flight; a prefetch waits for nothing (offload.py)
        if not b.gathered and b.gather_handle is None:
            b.full.untyped_storage().resize_(b.padded * b.full.element_size())
            b.gather_handle = self.e.comm.all_gather(b.full, b.data, b.group)
        if wait and b.gather_handle is not None:
            b.gather_handle.wait()
            b.gather_handle = None
            b.gathered = True

    def _release(self, b):
        if self.keep_gathered:
            return
        if b.gather_handle is not None:  # a gather in flight lands first: else it would land later,
            self._gather(b)  # with the values of before an optimizer step, into freed memory
        if not b.gathered:
            return
        b.full.untyped_storage().resize_(0)
        b.gathered = False

    def _open_on_first_grad(self, b, _grad):
        if not b.open:
            self.e.grads.open(b)

    def _install(self):
        for chain in self.chains:
            for k, b in enumerate(chain):
                self._install_bucket(b, chain[k - 1] if k > 0 else None, chain[k + 1] if k + 1 < len(chain) else None,
                                     k == 0)

    def _install_bucket(self, b, nxt, prev, last_block):
        """Block bucket b's hooks; nxt, prev: the next bucket of its chain in forward, backward order."""
        e = self.e

        def pre(_mod, _args, b=b, nxt=nxt):
            self._gather(b)
            if e.backward_phase or not torch.is_grad_enabled():
                return  # a recomputation inside the backward, or evaluation
            if nxt is not None:
                self._gather(nxt, wait=False)
            if self._watch is not None:  # another bucket of this block is watched already: both
                b.needs_full = False
                self._watched.append(b)
                return
            # Other code's saved-tensor hooks (torch.utils.checkpoint's under --recompute, whose
            # backward runs the forward again; save_on_cpu): ours would hide theirs. Gather again.
            b.needs_full = _other_saved_tensor_hooks()
            if not b.needs_full:
                self._watched = [b]
                self._watch = torch.autograd.graph.saved_tensors_hooks(self._saved, _same)
                self._watch.__enter__()

        def post(_mod, _args, out, b=b, prev=prev, last_block=last_block):
            if e.backward_phase or not torch.is_grad_enabled():
                return
            self._watched = [w for w in self._watched if w is not b]
            if not self._watched:
                self._stop_watching()
            if out is None:  # the forward raised (always_call)
                return
            if b.zero == 3 and not (last_block and b.needs_full):  # else the backward needs it again at once
                self._release(b)

            def reached(grad, b=b, prev=prev):
                if e.input_only:  # zb's B: the weights' gradients come at W, which opens the bucket
                    return grad
                if b.zero == 3:
                    if b.needs_full:
                        self._gather(b)
                    # the bucket before b (in forward order) is gathered as b's backward starts if
                    # its own backward reads it, or if it is the first block and a forward follows
                    if prev is not None and (prev.needs_full or (prev in self.kept and not e.last)):
                        self._gather(prev, wait=False)
                if not b.sourced:
                    e.grads.open(b)
                return grad

            if out.requires_grad:
                out.register_hook(reached)

        if b.zero == 3:
            b.modules[0].register_forward_pre_hook(pre)
        b.modules[-1].register_forward_hook(post, always_call=True)

    def _stop_watching(self):
        if self._watch is not None:
            self._watch.__exit__(None, None, None)
            self._watch = None
        self._watched = []

    def _saved(self, t):
        """Autograd keeps t for a watched bucket's backward: will the backward read its gathered
        buffer? (Seen here: what goes through save_for_backward. A custom autograd function that
        keeps a parameter as a plain ctx attribute would escape this check; ours do not.)"""
        for b in self._watched:
            if t.device != b.full.device or t.untyped_storage().data_ptr() != b.full.untyped_storage().data_ptr():
                continue
            if b.small.get(t.storage_offset()) == t.numel() and t.dim() == 1:
                return t.clone()  # a LayerNorm weight, a bias: a copy, so the bucket can go
            b.needs_full = True
        return t


def _same(t):
    return t


def _other_saved_tensor_hooks() -> bool:
    """Are saved-tensor hooks of other code active? (A private torch query; if it fails, say yes:
    gathering again is always correct.)"""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
    except (AttributeError, TypeError, RuntimeError):
        return True
