"""The step over the members left: the lost ranks' micro-batches divided among them, the sums by
global number (parallel/slots.py), so that a redone step -- and every step until the world is whole
again -- adds up as the uninterrupted run's did.

The run starts with D data ranks (replicas: under pp, tp or cp, a replica's ranks share its slot,
replicas.py), each reading its slot of m micro-batches of every step: global micro-batch g = slot * m
+ j is sequences g*b .. g*b+b-1 of the step (data.py: a pure function of (step, sequence)). After a
loss each replica left keeps its own slot and takes a contiguous share of the orphaned slots'
micro-batches. Under cp, cp rank c's part of micro-batch g is leaf c*M + g of the step's tree (M
micro-batches a step: the replicas' tree is cp-major, mesh.py). The loss and, in exact mode, the
gradient are summed along the one tree the uninterrupted run used: each rank sums the complete
subtrees of the micro-batches it ran (LiveTree), the pieces cross its reduce group in one
all-to-all, each rank folds its slice -- under ZeRO 1-3 its own shard, which is all it keeps;
under ZeRO-0 a slice that an all-gather then makes whole.
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
    now, in group order -- replicas, replica (this rank's), grid, D, m and b, its passes, engine,
    loader and mesh)."""

    def redivide(self) -> None:
        """The step's work over the members now: each slot its own rank's, as the job began -- then
        the engine's own paths -- or, with slots missing, divided (divide)."""
        if self.replicas != list(range(self.D)):
            self.divide()
            return
        if not self.degraded:
            return
        p, e = self.passes, self.engine
        self.degraded = False
        self.plan = {i: list(range(i * self.m, (i + 1) * self.m)) for i in self.replicas}
        self.tokens = torch.zeros((2, self.batch.seqs_per_rank, self.cfg.seq_len), dtype=torch.long, device=self.device)
        p.tokens, self.next_tokens = self.tokens, (None, None)
        p.__dict__.pop("train_step", None), p.__dict__.pop("validate", None)
        if e.exact:
            e.trees = {b: TreeSum(e.grads.recycle) for b in e.buckets}
            if e.tied.head is not None:
                e.tied.head = TreeSum(e.grads.recycle)
            e.__dict__.pop("exact_reduce", None)

    def divide(self) -> None:
        """Each replica keeps its slot's micro-batches and takes a contiguous share of the slots
        nobody holds now; the engine, the passes and the loss then work by global number."""
        self.plan = shares(self.replicas, self.D, self.m)
        self.keys = {r: forest(self.leaves(r)) for r in self.ids}
        mine, lay = self.plan[self.replica], self.layout
        e, p = self.engine, self.passes
        # ZeRO-2/3 run collectives in every micro-batch (reduce-scatters, gathers): each member runs
        # as many passes as the largest share, the extra ones repeating its last micro-batch for
        # nothing -- no gradient, no loss -- so that the collectives line up (the step lasts as
        # long as the largest share anyway); the interleaved pipeline, a multiple of pp passes
        n = max(map(len, self.plan.values())) if e.zero >= 2 else len(mine)
        self.passes_n = -(-n // lay.pp) * lay.pp if lay.schedule == "interleaved" else n
        self.degraded = True
        self.tokens = torch.zeros((2, self.passes_n * self.b, self.cfg.seq_len), dtype=torch.long, device=self.device)
        p.tokens, self.next_tokens = self.tokens, (None, None)

        def forward(stage, micro, inp):
            out = p.forward(stage, micro, inp)
            return out * 0 if micro >= len(mine) else out

        p.executor = executor = p.executor_of(forward, divisor=self.batch.total_tokens)
        actions = schedule.build(lay.schedule, self.passes_n, lay.pp, lay.virtual)[self.mesh.coord("pp")]
        p.train_step = lambda: executor.run(actions, self.passes_n)[: len(mine)]
        p.validate = self.validate
        if e.exact:
            self.pending, leaves = {}, self.leaves(self.rt.rank)
            e.trees = {b: LiveTree(e.grads, leaves, self.pending) for b in e.buckets}
            if e.tied.head is not None:
                e.tied.head = LiveTree(e.grads, leaves, self.pending)
            e.exact_reduce = self.exact_reduce

    def leaves(self, r: int, plan: dict | None = None, total: int | None = None) -> list[int]:
        """Rank r's leaves of the step's tree (or of `plan`'s, `total` micro-batches): its replica's
        micro-batches, cp-major (module docstring)."""
        g, plan, total = self.grid, plan or self.plan, total or self.M
        return [g.cp_rank(r) * total + i for i in plan[g.replica(r)]]

    def host_tokens(self, step: int) -> torch.Tensor:
        if not self.degraded:
            return super().host_tokens(step)
        mine = self.plan[self.replica]
        mine = mine + mine[-1:] * (self.passes_n - len(mine))  # (the passes for nothing: divide)
        xs, ys = zip(*(self.built.loader.batch(step, g * self.b, self.b) for g in mine))
        return torch.stack((torch.cat(xs), torch.cat(ys)))

    def by_number(self, values: list[torch.Tensor], plan: dict, total: int) -> float:
        """The loss sums of the step (plan: replica -> its micro-batches of `total`), every member's
        that counts (the last stage's at tp 0, passes.reduce_loss's) summed by global number."""
        numbers = {r: self.leaves(r, plan, total) if self.grid.counts_loss(r) else [] for r in self.ids}
        return sum_by_number(self.comm, self.mesh.groups["world"], self.ids, values, numbers, self.grid.cp * total)

    def reduce_loss(self, losses: list[torch.Tensor]) -> float:
        if not self.degraded:
            return super().reduce_loss(losses)
        return self.by_number(losses, self.plan, self.M)

    def exact_reduce(self, b, grad, out, full, scratch):
        """Exact mode's reduction after a change (in place of Engine.exact_reduce): the subtrees of
        `grad`'s bucket of the members of its reduce group summed along the step's one tree into
        `out` -- the whole bucket (ZeRO-0: `full`), or this rank's shard of it (slots.reduce_forests)."""
        nodes, group = self.pending.pop(id(grad)), b.group
        reduce_forests(self.comm, group, list(group.ranks), self.keys, self.rt.rank, nodes, self.grid.cp * self.M, out,
                       whole=full)
        for t in nodes.values():
            self.engine.grads.recycle(t)
        return _Done()

    @torch.no_grad()
    def validate(self, device) -> float:
        """Passes.validate after a change: the validation micro-batches divided among the members
        in contiguous shares, their losses summed by global number (the same bits)."""
        p, cfg, b = self.passes, self.cfg, self.b
        total = cfg.val_steps * self.batch.seqs_per_step
        micros, n = total // b, len(self.replicas)
        cuts = [k * (micros // n) + min(k, micros % n) for k in range(n + 1)]
        plan = {i: list(range(cuts[k], cuts[k + 1])) for k, i in enumerate(self.replicas)}
        mine = plan[self.replica]
        xy = torch.stack(self.built.val_loader.val_batch(mine[0] * b, len(mine) * b)).to(device) if mine else None

        def forward(stage, micro, inp):
            part = p.stage[stage]
            x, y = p.micro_batch(xy, micro)
            with p.autocast():
                return part(x if part.first else inp, y if part.last else None).float()

        for part in p.parts:
            part.eval()
        with self.engine.gathered():  # (ZeRO-3: every member gathers once, whatever its share)
            sums = p.executor_of(forward).run(p.forward_only(len(mine)), len(mine), train=False) if mine else []
        for part in p.parts:
            part.train()
        return self.by_number(sums, plan, micros) / (total * cfg.seq_len)
