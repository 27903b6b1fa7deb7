"""The step over the members left: the lost ranks' micro-batches divided among them, the sums by
global number (parallel/slots.py), so that a redone step -- and every step until the world is whole
again -- adds up as the uninterrupted run's did.

The run starts with D data ranks, each reading its slot of m micro-batches of every step: global
micro-batch g = slot * m + j is sequences g*b .. g*b+b-1 of the step (data.py: a pure function of
(step, sequence)). After a loss each member keeps its own slot and takes a contiguous share of the
orphaned slots' micro-batches. The loss and, in exact mode, the gradient are summed along the one
tree the uninterrupted run used: each rank sums the complete subtrees of the micro-batches it ran
(LiveTree), the pieces cross ranks in one all-to-all, each rank folds its slice -- under ZeRO 1-3
its own shard, which is all it keeps; under ZeRO-0 a slice that an all-gather then makes whole.
"""

from __future__ import annotations

import torch

from braidtrain.parallel import schedule
from braidtrain.parallel.exact import TreeSum
from braidtrain.parallel.slots import LiveTree, forest, reduce_forests, shares, sum_by_number


class _Done:
    def wait(self):
        pass


class Redo:
    """LiveTrainer's division of the step's work (a mixin: it reads the trainer's ids -- the members
    now, in group order -- D, m and b, its passes, engine, loader and mesh)."""

    def redivide(self) -> None:
        """The step's work over the members now: each slot its own rank's, as the job began -- then
        the engine's own paths -- or, with slots missing, divided (divide)."""
        if self.ids != list(range(self.D)):
            self.divide()
            return
        if not self.degraded:
            return
        p, e = self.passes, self.engine
        self.degraded = False
        self.plan = {i: list(range(i * self.m, (i + 1) * self.m)) for i in self.ids}
        self.tokens = torch.zeros((2, self.batch.seqs_per_rank, self.cfg.seq_len), dtype=torch.long, device=self.device)
        p.tokens, self.next_tokens = self.tokens, (None, None)
        p.__dict__.pop("train_step", None), p.__dict__.pop("validate", None)
        if e.exact:
            e.trees = {b: TreeSum(e.recycle) for b in e.buckets}
            if e.tied.head is not None:
                e.tied.head = TreeSum(e.recycle)
            e.__dict__.pop("exact_reduce", None)

    def divide(self) -> None:
        """Each member keeps its slot's micro-batches and takes a contiguous share of the slots
        nobody holds now; the engine, the passes and the loss then work by global number."""
        self.plan = shares(self.ids, self.D, self.m)
        self.keys = {i: forest(g) for i, g in self.plan.items()}
        mine = self.plan[self.rt.rank]
        e, p = self.engine, self.passes
        # ZeRO-2/3 run collectives in every micro-batch (reduce-scatters, gathers): each member runs
        # as many passes as the largest share, the extra ones repeating its last micro-batch for
        # nothing -- no gradient, no loss -- so that the collectives line up (the step lasts as
        # long as the largest share anyway)
        self.passes_n = max(map(len, self.plan.values())) if e.zero >= 2 else len(mine)
        self.degraded = True
        self.tokens = torch.zeros((2, self.passes_n * self.b, self.cfg.seq_len), dtype=torch.long, device=self.device)
        p.tokens, self.next_tokens = self.tokens, (None, None)

        def forward(stage, micro, inp):
            out = p.forward(stage, micro, inp)
            return out * 0 if micro >= len(mine) else out

        executor = p.executor_of(forward, divisor=self.batch.total_tokens)
        actions = schedule.build("sequential", self.passes_n)[0]
        p.train_step = lambda: executor.run(actions, self.passes_n)[: len(mine)]
        p.validate = self.validate
        if e.exact:
            self.pending = {}
            e.trees = {b: LiveTree(e, mine, self.pending) for b in e.buckets}
            if e.tied.head is not None:
                e.tied.head = LiveTree(e, mine, self.pending)
            e.exact_reduce = self.exact_reduce

    def host_tokens(self, step: int) -> torch.Tensor:
        if not self.degraded:
            return super().host_tokens(step)
        mine = self.plan[self.rt.rank]
        mine = mine + mine[-1:] * (self.passes_n - len(mine))  # (the passes for nothing: divide)
        xs, ys = zip(*(self.built.loader.batch(step, g * self.b, self.b) for g in mine))
        return torch.stack((torch.cat(xs), torch.cat(ys)))

    def by_number(self, values: list[torch.Tensor], plan: dict, total: int) -> float:
        return sum_by_number(self.comm, self.mesh.groups["world"], self.ids, values, plan, total)

    def reduce_loss(self, losses: list[torch.Tensor]) -> float:
        if not self.degraded:
            return super().reduce_loss(losses)
        return self.by_number(losses, self.plan, self.M)

    def exact_reduce(self, b, grad, out, full, scratch):
        """Exact mode's reduction after a change (in place of Engine.exact_reduce): the members'
        subtrees of `grad`'s bucket summed along the step's one tree into `out` -- the whole
        bucket (ZeRO-0: `full`), or this rank's shard of it (slots.reduce_forests)."""
        nodes = self.pending.pop(id(grad))
        reduce_forests(self.comm, self.mesh.groups["world"], self.ids, self.keys, self.rt.rank, nodes, self.M, out,
                       whole=full)
        for t in nodes.values():
            self.engine.recycle(t)
        return _Done()

    @torch.no_grad()
    def validate(self, device) -> float:
        """Passes.validate after a change: the validation micro-batches divided among the members
        in contiguous shares, their losses summed by global number (the same bits)."""
        p, cfg, b = self.passes, self.cfg, self.b
        total = cfg.val_steps * self.batch.seqs_per_step
        micros, n = total // b, len(self.ids)
        cuts = [k * (micros // n) + min(k, micros % n) for k in range(n + 1)]
        plan = {i: list(range(cuts[k], cuts[k + 1])) for k, i in enumerate(self.ids)}
        mine = plan[self.rt.rank]
        xy = torch.stack(self.built.val_loader.val_batch(mine[0] * b, len(mine) * b)).to(device) if mine else None

        def forward(stage, micro, inp):
            part = p.stage[stage]
            x, y = p.micro_batch(xy, micro)
            with p.autocast():
                return part(x, y).float()

        for part in p.parts:
            part.eval()
        with self.engine.gathered():  # (ZeRO-3: every member gathers once, whatever its share)
            sums = p.executor_of(forward).run(p.forward_only(len(mine)), len(mine), train=False) if mine else []
        for part in p.parts:
            part.train()
        return self.by_number(sums, plan, micros) / (total * cfg.seq_len)
