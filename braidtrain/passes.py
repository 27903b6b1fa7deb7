"""The passes through this rank's model parts (the model, or its pipeline chunks), each run by
the schedule's executor (parallel/schedule.py): the training step's forwards and backwards, the
forward-only passes of validation and sampling, and what the step's work says of the pipeline's
bubble -- per stage each step, and every rank's timeline of the last step for `braidtrain plot
--schedule`. The loss lives on the ranks of the last chunk; reduce_loss brings it to every rank.
"""

from __future__ import annotations

import json

import torch

from braidtrain.comm import pairwise_sum
from braidtrain.parallel import schedule


def reduce_loss(comm, mesh, sums: list[torch.Tensor]) -> float:
    """The loss sums of every rank that holds them (mesh.loss_ranks: under tp each tp rank holds
    the same full sum, one counts), added along one fixed tree in (data rank, micro-batch) order:
    the same bits on every rank and in every layout."""
    t = torch.stack(sums).double() if sums else torch.zeros(0, dtype=torch.float64, device=comm.device)
    rows = comm.gather_rows(t, mesh.groups["world"])
    return pairwise_sum(rows[mesh.loss_ranks()].reshape(-1)).item()


class Passes:
    def __init__(self, built, autocast, tokens):
        self.b, self.autocast, self.tokens = built, autocast, tokens  # tokens: the step's (2, rows, T) device buffer
        self.lay, self.mesh, self.comm, self.cfg = built.layout, built.mesh, built.comm, built.cfg
        self.parts, self.stage = built.parts, {part.stage: part for part in built.parts}
        lay = self.lay
        self.actions = schedule.build(lay.schedule, lay.batch.micro_steps, lay.pp, lay.virtual)[self.mesh.coord("pp")]
        self.executor = self.executor_of(self.forward, divisor=lay.batch.total_tokens)

    def executor_of(self, forward, divisor=1, seq_len=None, rows=None) -> schedule.Executor:
        """An executor of this rank's chunks; the activations it moves are (rows, seq_len / tp if
        sp, n_embd) -- a micro-batch's by default."""
        lay, t = self.lay, seq_len or self.cfg.seq_len
        shape = (rows or self.cfg.batch_size, t // lay.tp if lay.sp else t, self.b.mcfg.n_embd)
        return schedule.Executor(self.b.engine, forward, divisor, p2p=self.mesh.p2p, pp=lay.pp,
                                 chunks=lay.pp * lay.virtual, shape=shape)

    def forward(self, stage: int, micro: int, inp) -> torch.Tensor:
        """Micro-batch `micro` through chunk `stage`: on the last, the sum of its token losses."""
        b, part = self.cfg.batch_size, self.stage[stage]
        x, y = self.tokens[:, micro * b : (micro + 1) * b]
        with self.autocast():
            out = part(x if part.first else inp, y if part.last else None)
        if self.b.fault and micro == 0 and part is self.parts[0]:
            self.b.fault.mid_step(self.comm.step)
        return out

    def train_step(self) -> list[torch.Tensor]:
        """The step's forwards and backwards: the micro-batches' loss sums (on the last chunk's ranks)."""
        return self.executor.run(self.actions, self.lay.batch.micro_steps)

    def forward_only(self, n_micro: int) -> list:
        """This rank's actions of a forward-only pass of n_micro micro-batches through the pipeline."""
        if self.lay.pp == 1:
            return [schedule.Action("F", 0, m) for m in range(n_micro)]
        from braidtrain.parallel import pipeline

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
            x, y = xy[:, micro * b : (micro + 1) * b]
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
        """The logits of token ids ctx (1, T) on the rank holding the head, else None: a
        forward-only pass of one micro-batch through the pipeline (generate.generate's logits_of)."""
        def forward(stage, _micro, inp):
            part = self.stage[stage]
            with self.autocast():
                return part(ctx if part.first else inp)

        logits = self.executor_of(forward, seq_len=ctx.shape[1], rows=1).run(self.forward_only(1), 1, train=False)[0]
        return logits if self.lay.pp * self.lay.virtual - 1 in self.stage else None

    def share_token(self, token):
        """The sampled token, from the last pipeline stage to every stage (generate's share)."""
        if self.lay.pp == 1:
            return token
        return self.comm.broadcast_object(None if token is None else token.cpu(), self.mesh.groups["pp"],
                                          src=self.lay.pp - 1)

    def bubbles(self) -> list[float]:
        """Per pipeline stage (the mean over its ranks): the share of the step's span of work that
        the rank idled -- 1 - (seconds of work) / (first work's start to last work's end). Call
        once the step's work is done."""
        work, span = self.executor.busy()
        mine = torch.tensor([1 - work / span if span > 0 else 0.0], dtype=torch.float64, device=self.comm.device)
        rows = self.comm.gather_rows(mine, self.mesh.groups["world"]).view(self.lay.pp, -1)  # pp is outermost
        return rows.mean(1).tolist()

    def write_schedule(self, path, bubble) -> None:
        """`path` (RUN/schedule.json): every rank's work in the last step -- (op, chunk,
        micro-batch, start, end) in seconds from the rank's first start -- for `braidtrain plot
        --schedule`. Collective over the world; rank 0 writes."""
        events = self.executor.events
        if self.comm.cuda:
            events = [(op, c, m, events[0][3].elapsed_time(s) / 1e3, events[0][3].elapsed_time(t) / 1e3)
                      for op, c, m, s, t in events]
        t0 = min((e[3] for e in events), default=0.0)
        ranks = self.comm.all_gather_object([(op, c, m, s - t0, t - t0) for op, c, m, s, t in events],
                                            self.mesh.groups["world"])
        if self.mesh.rank == 0:
            world = len(ranks)
            path.write_text(json.dumps({
                "schedule": self.lay.schedule, "pp": self.lay.pp, "virtual": self.lay.virtual,
                "stage_of_rank": [r // (world // self.lay.pp) for r in range(world)],
                "bubble": bubble, "ranks": ranks}) + "\n")
