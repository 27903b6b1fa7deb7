"""The passes through this rank's model parts (the model, or its pipeline chunks), each run by
the schedule's executor (parallel/schedule.py): the training step's forwards and backwards, the
forward-only passes of validation and sampling, and what the step's work says of the pipeline's
bubble -- per stage each step, and every rank's timeline of the last step for `braidtrain plot
--schedule`. The loss lives on the ranks of the last chunk; reduce_loss brings it to every rank.
"""

from __future__ import annotations

import json

import torch

from braidtrain.collective.comm import pairwise_sum
from braidtrain.parallel import pipeline, schedule
from braidtrain.parallel.actions import Action


def reduce_loss(comm, mesh, sums: list[torch.Tensor]) -> float:
    """The loss sums of every rank that holds them (mesh.loss_ranks: under tp each tp rank holds
    the same full sum, one counts; under cp each cp rank its tokens' part), added along one fixed
    tree in (cp rank, data rank, micro-batch) order: the same bits on every rank and in every
    layout of the same cp."""
    t = torch.stack(sums).double() if sums else torch.zeros(0, dtype=torch.float64, device=comm.device)
    rows = comm.gather_rows(t, mesh.groups["world"])[mesh.loss_ranks()]  # by (dp, cp)
    rows = rows.view(mesh.size("dp"), mesh.size("cp"), -1).transpose(0, 1)  # the replicas' order: cp-major
    return pairwise_sum(rows.reshape(-1)).item()


class Passes:
    def __init__(self, built, autocast, tokens):
        self.b, self.autocast, self.tokens = built, autocast, tokens  # tokens: the step's (2, rows, T) device buffer
        self.lay, self.mesh, self.comm, self.cfg = built.layout, built.mesh, built.comm, built.cfg
        self.parts, self.stage = built.parts, {part.stage: part for part in built.parts}
        lay = self.lay
        self.cp = getattr(self.parts[0], "cp", None)  # context parallelism: this rank's tokens of each sequence
        self.cp_index = None if self.cp is None else self.cp.positions(self.cfg.seq_len // lay.cp, tokens.device)
        self.actions = schedule.build(lay.schedule, lay.batch.micro_steps, lay.pp, lay.virtual)[self.mesh.coord("pp")]
        self.executor = self.executor_of(self.forward, divisor=lay.batch.total_tokens)

    def executor_of(self, forward, divisor=1, seq_len=None, rows=None) -> schedule.Executor:
        """An executor of this rank's chunks; the activations it moves are (rows, seq_len / tp if
        sp, n_embd) -- a micro-batch's by default."""
        lay, t = self.lay, seq_len or self.cfg.seq_len // self.lay.cp
        shape = (rows or self.cfg.batch_size, t // lay.tp if lay.sp else t, self.b.mcfg.n_embd)
        return schedule.Executor(self.b.engine, forward, divisor, p2p=self.mesh.p2p, pp=lay.pp,
                                 chunks=lay.pp * lay.virtual, shape=shape)

    def micro_batch(self, xy, micro: int):
        """Micro-batch `micro`'s inputs and targets (this rank's tokens of them under cp)."""
        b = self.cfg.batch_size
        xy = xy[:, micro * b : (micro + 1) * b]
        return xy if self.cp_index is None else xy[:, :, self.cp_index]

    def forward(self, stage: int, micro: int, inp) -> torch.Tensor:
        """Micro-batch `micro` through chunk `stage`: on the last, the sum of its token losses."""
        part = self.stage[stage]
        x, y = self.micro_batch(self.tokens, micro)
        with self.autocast():
            out = part(x if part.first else inp, y if part.last else None)
        if self.b.fault and micro == 0 and part is self.parts[0]:
            self.b.fault.mid_step(self.comm.step)
        if self.b.fault and part.last:
            out = self.b.fault.poison(self.comm.step, out)
        return out

    def train_step(self) -> list[torch.Tensor]:
        """The step's forwards and backwards: the micro-batches' loss sums (on the last chunk's ranks)."""
        return self.executor.run(self.actions, self.lay.batch.micro_steps)

    def forward_only(self, n_micro: int) -> list:
        """This rank's actions of a forward-only pass of n_micro micro-batches through the pipeline."""
        if self.lay.pp == 1:
            return [Action("F", 0, m) for m in range(n_micro)]
        return pipeline.forward_only(self.lay.pp, self.lay.virtual, n_micro)[self.mesh.coord("pp")]

    @torch.no_grad()
    def validate(self, device) -> float:
        """Mean loss over val_steps global batches of validation sequences, split over the data
        ranks (a forward-only schedule of them through the pipeline)."""
        cfg, b, lay = self.cfg, self.cfg.batch_size, self.lay
        total = cfg.val_steps * lay.batch.seqs_per_step
        per_rank = total // lay.dp  # a multiple of b: val_steps * micro-steps micro-batches
        xy = torch.stack(self.b.val_loader.val_batch(self.mesh.coord("dp") * per_rank, per_rank)).to(device)

        def forward(stage, micro, inp):
            part = self.stage[stage]
            x, y = self.micro_batch(xy, micro)
            with self.autocast():
                return part(x if part.first else inp, y if part.last else None).float()

        for part in self.parts:
            part.eval()
        with self.b.engine.gathered():
            sums = self.executor_of(forward).run(self.forward_only(per_rank // b), per_rank // b, train=False)
        for part in self.parts:
            part.train()
        return reduce_loss(self.comm, self.mesh, sums) / (total * cfg.seq_len)

    @torch.no_grad()
    def next_logits(self, ctx):
        """The logits of token ids ctx (B, T) on the rank holding the head, else None: a
        forward-only pass of one micro-batch through the pipeline (generate.generate's logits_of;
        the multiple-choice evaluation's, evaluate.py)."""
        def forward(stage, _micro, inp):
            part = self.stage[stage]
            with self.autocast():
                return part(ctx if part.first else inp)

        if self.cp is not None:  # whole sequences: every cp rank runs the same pass, attention local
            self.cp.active = False
        try:
            ex = self.executor_of(forward, seq_len=ctx.shape[1], rows=ctx.shape[0])
            logits = ex.run(self.forward_only(1), 1, train=False)[0]
        finally:
            if self.cp is not None:
                self.cp.active = True
        return logits if self.lay.pp * self.lay.virtual - 1 in self.stage else None

    def share_token(self, token):
        """The sampled token, from the last pipeline stage to every stage (generate's share)."""
        if self.lay.pp == 1:
            return token
        return self.comm.broadcast_object(None if token is None else token.cpu(), self.mesh.groups["pp"],
                                          src=self.lay.pp - 1)

    def bubbles(self) -> list[float]:
        """Per pipeline stage (the mean over its ranks): the share of the step's passes that the
        rank idled -- 1 - (seconds of work) / (the executor's run, start to end). Call once the
        step's work is done."""
        work, span = self.executor.busy()
        mine = torch.tensor([1 - work / span if span > 0 else 0.0], dtype=torch.float64, device=self.comm.device)
        rows = self.comm.gather_rows(mine, self.mesh.groups["world"]).view(self.lay.pp, -1)  # pp is outermost
        return rows.mean(1).tolist()

    def write_schedule(self, path, bubble) -> None:
        """`path` (RUN/schedule.json): every rank's work in the last step -- (op, chunk,
        micro-batch, start, end) in seconds from the rank's start of the step -- for `braidtrain plot
        --schedule`. Collective over the world; rank 0 writes."""
        ex = self.executor
        ranks = self.comm.all_gather_object([(op, c, m, ex.seconds(s), ex.seconds(t)) for op, c, m, s, t in ex.events],
                                            self.mesh.groups["world"])
        if self.mesh.rank == 0:
            world = len(ranks)
            path.write_text(json.dumps({
                "schedule": self.lay.schedule, "pp": self.lay.pp, "virtual": self.lay.virtual,
                "stage_of_rank": [r // (world // self.lay.pp) for r in range(world)],
                "bubble": bubble, "ranks": ranks}) + "\n")
