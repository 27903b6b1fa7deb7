"""The tied embedding: wte is the input embedding's lookup and the output head's weight.

One rank holding both uses, in default mode, lets autograd add the two gradients of each
micro-batch as they come (the embedding group's bucket holds wte). Exact mode keeps the two apart
instead, and so does any pipeline, whose first stage holds the lookup and last stage a copy of wte
for the head. Then wte is a bucket of its own -- the same buffer, padding and shards in every
layout -- and each use's gradient is summed over the step's micro-batches and reduced over dp like
any bucket; the two reduced gradients are then added, shard by shard, once a step:

    G = reduced lookup gradient + reduced head gradient

With one rank holding both (exact mode), the head's micro-batch gradients reach here through the
model's TiedHead and are summed in a tree of their own, its first level folded as the buckets'
(exact.py): an odd micro-batch's head gradient is added straight into its complete even sibling's
leaf -- the tree's own addition, since a leaf is a bitwise copy of the gradient. Across a pipeline
the first and last stages swap their reduced shards (one exchange over the pp group) and both add:
the same single addition of the same two sums, so G has the same bits as with one rank, and the two
copies, given the same gradient and update, stay bitwise equal. The copy is not saved, and counts
once in the gradient norm (placement: Placed.copy).
"""

from __future__ import annotations

from braidtrain.parallel import exact as exact_sums


class Tied:
    @staticmethod
    def kept_apart(table, exact: bool) -> set[str]:
        """The tied parameters whose two uses are summed apart: in exact mode, and wherever a
        pipeline puts the uses on two stages (a rank then holds one of them)."""
        return {e.name for e in table if e.users and (exact or len(e.users) == 1)}

    def __init__(self, engine):
        self.e = engine
        apart = Tied.kept_apart(engine.table, engine.exact)
        self.buckets = [b for b in engine.buckets if b.params[0][0] in apart]  # each holds one tied parameter
        split = any(len(engine.table[name].users) == 1 for name in apart)
        self.partner = engine.pp.size - 1 - engine.pp.index if split else None  # first stage <-> last stage
        self.head = None  # exact mode, both uses here: the head's micro-batch gradients' tree
        if self.buckets and not split:
            self.head = exact_sums.TreeSum(engine.grads.recycle)
            b = self.buckets[0]  # the exact reduction's all-to-all needs a scratch of its own
            self.scratch = engine.grads.take(b.padded) if b in engine.scratch else None
            for part in engine.parts:
                part.use_head_sink(self.sink)
        self.handle = self.head_sum = self.head_out = None

    def laid_out_again(self):
        """(Engine.laid_out_again) the head's reduction scratch, sized by the bucket's new padding."""
        if self.head is not None:
            b = self.buckets[0]
            self.scratch = self.e.grads.take(b.padded) if b in self.e.scratch else None

    def begin_step(self):
        if self.head is not None:
            self.head.clear()

    def sink(self, grad):
        """One micro-batch's head gradient of wte (the model's TiedHead calls this), as a leaf laid
        out like wte's bucket."""
        b, n, micro = self.buckets[0], grad.numel(), self.e.micro
        into = self.head.sibling(micro) if self.e.fold else None
        if into is not None:  # the first level folded (exact.py): the sibling leaf + this one, as the tree adds
            into[:n].add_(grad.reshape(-1))  # (past n both are zeros: the sum too)
            self.head.add(micro, into)
            return
        leaf = self.e.grads.take(b.padded)
        leaf[:n].copy_(grad.reshape(-1))
        leaf[n:].zero_()
        self.head.add(micro, leaf)

    def reduced(self, b):
        """Bucket b's own reduction was launched (the step's last backward): with both uses here,
        the head's sum is reduced beside it, the same way."""
        if self.head is None or b not in self.buckets:
            return
        e = self.e
        self.head_sum = self.head.total(e.n_micro)
        out, full = e.owned_grad(b)
        self.head_out = self.head_sum if full else out.new_empty(out.numel())
        self.handle = e.exact_reduce(b, self.head_sum, self.head_out, full, self.scratch)

    def combine(self):
        """After the step's reductions: add the other use's reduced gradient into each tied bucket's
        part of it."""
        for b in self.buckets:
            mine = self.e.owned_grad(b)[0]
            if self.head is not None:
                self.handle.wait()
                mine.add_(self.head_out)
                self.e.grads.recycle(self.head_sum)
                self.handle = self.head_sum = self.head_out = None
            else:
                other = mine.new_empty(mine.numel())
                # (live recovery: every member of the group must take part, comm.send_recv -- so the
                # first and last stages' own pair, mesh.p2p, which build.py makes there at any pp)
                pair = self.e.p2p.get((0, self.e.pp.size - 1)) if self.e.comm.abort is not None else None
                group, partner = (pair, 1 - pair.index) if pair else (self.e.pp, self.partner)
                self.e.comm.send_recv(mine, other, partner, partner, group).wait()
                mine.add_(other)
