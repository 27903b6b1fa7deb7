"""The placement table: for every parameter, where it lives and which group reduces its gradient.

    name               full shape    tp split             unit    stage  expert  reduced over  users
    wte.weight         (V_pad, C)    rows (x 128*tp pad)  embed   0      no      replica       lookup, head
    wpe.weight         (T, C)        replicated           embed   0      no      replica       lookup
    h.3.attn.c_attn.*  (3C, C)       rows, q k v apart    block 3 0      no      replica
    h.3.attn.c_proj.w  (C, C)        columns              block 3 0      no      replica
    h.3.ln_1.*, biases of c_proj     replicated           block 3 0      no      replica
    h.2.mlp.router.weight  (E, C)    replicated           block 2 0      no      replica
    h.2.mlp.experts.c_fc.weight      replicated;          block 2 0      yes     expert (its ep rank's)
      (E, H, C) ...                  dim 0 over ep
    ...

Built once from the model and its layout: each tp layer declares how its parameters split
(`tp_split`, model/layers.py), the model its units (what is gathered and reduced together: the
embedding group and each block), stages and the users of a tied parameter. The full shape is
the tp = 1 shape -- what checkpoints store and weights_sha256 hashes, whatever the layout; under
tp a split dim with `align` > 1 is padded with zero rows to a multiple of align * tp (wte's
vocabulary), and `shard` / `unshard` add and cut that padding, so no one else special-cases it.

Experts. A mixture's experts of one layer are stacked (model/moe.py): one parameter per weight
kind, dim 0 the E experts -- its full shape (E, ...) -- of which ep rank r holds the run
[r E/ep, (r+1) E/ep) (`Table.held`, `Table.local`). Each expert's slice is its own unit beside
that: initialised from its own generator under its per-expert name (`expert_name`: the layer's
experts.<e>.<kind>, the name such a parameter had when each expert was a module of its own --
older checkpoints use it, and `per_expert` lists every parameter so, in that order), its own
Q-aligned run of a bucket, and its own term of exact mode's gradient norm: so a stacked model
computes, initialises and sums as the per-expert one did, at every ep degree.

Readers: the buckets (parallel/buckets.py: one per unit and reduce group), the optimizer (weight
decay on 2-D weights), clipping (a tp-replicated parameter counted once, on tp rank 0), sp's
partial gradients (the replicated ones, summed over tp), checkpoints (the table is saved in
meta.json, so a checkpoint reads back in any layout without the model), export (the names and
shapes it expects of a HuggingFace file) and the planner (parameter counts, buckets). Nobody
infers placement from a parameter's name.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch

from braidtrain.model import registry
from braidtrain.model.layers import REPLICATED, ShardSpec, shard_of, unshard
from braidtrain.model.protocol import full_init


@dataclass(frozen=True)
class Placed:
    name: str
    shape: tuple  # full, unsharded, as at tp = 1
    split: ShardSpec  # how it splits over tp
    unit: int  # 0: the embedding group; 1 + i: block i (model.param_units order)
    stage: int = 0  # pipeline stage (all 0 until pipeline parallelism)
    expert: bool = False  # held by one ep rank (and its expert group); dense ones by every rank
    reduce: str = "replica"  # the mesh group that reduces its gradient (mesh.groups key)
    users: tuple = ()  # of a parameter used in two places (the tied wte), the uses this rank performs
    copy: bool = False  # a copy of another stage's parameter (a last stage's wte): saved, counted once there
    partial: bool = False  # replicated, but each tp rank's gradient a part (a qk-norm over each rank's heads)

    @property
    def replicated(self) -> bool:
        return self.split.kind == "replicated"

    @property
    def decays(self) -> bool:
        """Weight decay applies to 2-D weights (an expert's: its slice), not to biases and LayerNorms."""
        return len(self.shape) - self.expert >= 2

    def full_shape(self, tp: int) -> tuple:
        """The unsharded shape in a layout of this tp: the split dim padded to align * tp."""
        if self.replicated or self.split.align == 1:
            return self.shape
        d, step = self.split.dim, self.split.align * tp
        return (*self.shape[:d], -(-self.shape[d] // step) * step, *self.shape[d + 1:])

    def local_shape(self, tp: int) -> tuple:
        shape = list(self.full_shape(tp))
        if not self.replicated:
            shape[self.split.dim] //= tp
        return tuple(shape)

    def local_numel(self, tp: int) -> int:
        return math.prod(self.local_shape(tp))

    def shard(self, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
        """Tp rank `rank`'s piece of the full tensor (padded with zeros for this tp first)."""
        want, d = self.full_shape(tp), self.split.dim
        if not self.replicated and full.shape[d] != want[d]:  # (a stack of experts: the rank's, in dim 0)
            pad = full.new_zeros(*want[:d], want[d] - full.shape[d], *want[d + 1:])
            full = torch.cat([full, pad], d)
        return shard_of(full, self.split, rank, tp)

    def unshard(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from tp ranks 0, 1, ...'s pieces, padding cut off."""
        full = unshard(pieces, self.split)
        if not self.replicated and full.shape[self.split.dim] != self.shape[self.split.dim]:
            full = full.narrow(self.split.dim, 0, self.shape[self.split.dim]).contiguous()
        return full

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "split": list(self.split), "unit": self.unit, "stage": self.stage,
                "expert": self.expert, "reduce": self.reduce, "users": list(self.users), "copy": self.copy,
                "partial": self.partial}

    @staticmethod
    def from_json(name: str, d: dict) -> Placed:
        return Placed(name, tuple(d["shape"]), ShardSpec.from_json(d["split"]), d["unit"], d["stage"], d["expert"],
                      d["reduce"], tuple(d["users"]), d.get("copy", False), d.get("partial", False))


class Table:
    """The placed parameters in canonical (named_parameters) order, and this rank's tp position.
    `units`: (module, [Placed]) in forward order -- module None for the embedding group, else
    the block whose hooks gather and reduce it (absent in a table read from a checkpoint)."""

    def __init__(self, entries: list[Placed], tp: int = 1, tp_rank: int = 0, sp: bool = False, modules=None,
                 ep: int = 1, ep_rank: int = 0):
        self.entries, self.tp, self.tp_rank, self.sp = entries, tp, tp_rank, sp
        self.ep, self.ep_rank = ep, ep_rank
        self.by_name = {e.name: e for e in entries}
        n_units = 1 + max(e.unit for e in entries)
        mods = modules if modules is not None else [None] * n_units
        self.units = [(mods[u], [e for e in entries if e.unit == u]) for u in range(n_units)]

    def __getitem__(self, name: str) -> Placed:
        return self.by_name[name]

    def __iter__(self):
        return iter(self.entries)

    def sp_partial(self) -> set[str]:
        """Parameters whose gradient on each tp rank is only a part, summed over tp before use
        (Megatron's "sequence-parallel" parameters). Under sp the tp-replicated parameters --
        LayerNorms, wpe, the row-parallel biases -- act on this rank's T/tp rows of the sequence
        only, so each rank's gradient is the sum over its rows; without sp they see the whole
        sequence on every rank and their gradients are already complete (and equal) on each -- but
        for those a layer declares partial (`tp_partial`: a norm over each rank's own heads)."""
        return {e.name for e in self.entries if self.tp > 1 and e.replicated and (self.sp or e.partial)}

    def counted_here(self, e: Placed) -> bool:
        """Whether this rank's copy counts in the gradient norm: a tp-replicated parameter on tp
        rank 0, a parameter held on two stages on the first."""
        return (not e.replicated or self.tp_rank == 0) and not e.copy

    def held(self, e: Placed) -> range:
        """The experts of stacked parameter e this rank holds (range(1): a parameter of no experts)."""
        if not e.expert:
            return range(1)
        n = e.shape[0] // self.ep
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)

    def local(self, e: Placed, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of e's full tensor: its tp shard, of its experts."""
        full = full[self.held(e).start : self.held(e).stop] if e.expert else full
        return e.shard(full, self.tp_rank, self.tp)

    def offset(self, e: Placed) -> int:
        """Where this rank's piece starts in e's flattened tp shard: past the other ep ranks' experts."""
        return self.held(e).start * e.local_numel(self.tp) // e.shape[0] if e.expert else 0

    def to_json(self) -> dict:
        return {e.name: e.to_json() for e in self.entries}

    @staticmethod
    def from_json(d: dict) -> Table:
        return Table([Placed.from_json(name, v) for name, v in d.items()])


def build(parts) -> Table:
    """The table of a model (a model/protocol.Stage), or of the pipeline chunks one rank holds (a list):
    every parameter with its layer's tp split (replicated where the layer declares none), its unit,
    chunk and uses. Full shapes are those of the whole model at tp = 1."""
    parts = parts if isinstance(parts, list) else [parts]
    model = parts[0]
    whole = (len(parts) == 1 and model.tp == 1 and model.first and model.last  # (what for_config builds)
             and model.dispatch.n == 1)
    full = ({n: tuple(p.shape) for n, p in model.named_parameters()} if whole
            else {e.name: e.shape for e in for_config(model.cfg)})
    entries, modules = [], []
    for part in parts:
        unit_of = {}
        for module, names in part.param_units():
            unit_of.update(dict.fromkeys(names, len(modules)))
            modules.append(module)
        split_of, experts, partial = {}, set(), set()
        for mod_name, module in part.named_modules():
            for pname, split in getattr(module, "tp_split", {}).items():
                split_of[f"{mod_name}.{pname}" if mod_name else pname] = split
            partial.update(f"{mod_name}.{pname}" for pname in getattr(module, "tp_partial", ()))
            if getattr(module, "expert", False):  # an expert's parameters (model/moe.py)
                experts.update(f"{mod_name}.{pname}" for pname, _ in module.named_parameters())
        users, copies = part.tied_users(), part.copies()
        entries += [Placed(n, full[n], split_of.get(n, REPLICATED), unit_of[n], part.stage, expert=n in experts,
                           reduce="expert" if n in experts else "replica", users=users.get(n, ()), copy=n in copies,
                           partial=n in partial)
                    for n, _ in part.named_parameters()]
    return Table(entries, model.tp, model.tp_rank, model.sp, modules, model.dispatch.n, model.ep_rank)


@functools.lru_cache(maxsize=32)
def for_config(cfg) -> Table:
    """The table of a model config at tp = 1, from a model built on the meta device (no memory, no
    initialisation): the full shapes of a split model's table, a checkpoint saved before tables
    were saved, export and the planner."""
    with torch.device("meta"):
        return build(registry.build(cfg))


@functools.lru_cache(maxsize=256)
def for_rank(cfg, split: tuple, pp: int, r: int) -> Table:
    """The table of pipeline rank r's chunks (tp = 1 shapes, meta device): what that rank holds,
    a last stage's copy of a tied embedding included -- the planner's per-stage memory."""
    with torch.device("meta"):
        return build(registry.pipeline_chunks(cfg, split, pp, r))


def expert_name(name: str, e: int) -> str:
    """Expert e's slice of stacked parameter `name` under its own name: layers.3.mlp.experts.<e>.down_proj
    .weight for layers.3.mlp.experts.down_proj.weight."""
    head, tail = name.split(".experts.", 1)
    return f"{head}.experts.{e}.{tail}"


def stacked_name(name: str) -> tuple[str, int] | None:
    """(the stacked parameter, e) of a per-expert name (expert_name's inverse); None for another name."""
    head, sep, tail = name.partition(".experts.")
    e, dot, kind = tail.partition(".")
    return (f"{head}.experts.{kind}", int(e)) if sep and dot and e.isdigit() else None


def per_expert(entries) -> list[tuple[Placed, int | None]]:
    """Every parameter as (entry, None), and each stacked one as (entry, e) for each of its experts
    e, in the order the per-expert model's parameters had: a layer's experts one after another, each
    with all its weight kinds -- exact mode's gradient norm and the weights' hash go in this order."""
    out = []  # (grouped: a block's stacks of experts)
    for _, run in itertools.groupby(entries, lambda e: (e.stage, e.unit) if e.expert else e.name):
        run = list(run)
        out += [(r, i) for i in range(run[0].shape[0]) for r in run] if run[0].expert else [(run[0], None)]
    return out


@torch.no_grad()
def init_weights(model, seed: int) -> None:
    """Each parameter is this tp rank's slice of its full, layout-independent initial tensor, drawn
    from its own generator as its family says (init_std; under tp, the vocabulary's further padding
    rows are zeros: never looked up nor predicted); a stacked expert parameter, each of this rank's
    experts from the generator of its per-expert name (expert_name)."""
    fam = registry.family_of(model.cfg)
    table = build(model)
    for name, p in model.named_parameters():
        e = table[name]
        std, norm = fam.init_std(model.cfg, name), fam.is_norm(name)
        if e.expert:
            full = torch.stack([full_init(std, expert_name(name, i), e.shape[1:], seed, norm) for i in table.held(e)])
        else:
            full = full_init(std, name, e.shape, seed, norm)
        p.copy_(e.shard(full, model.tp_rank, model.tp))
