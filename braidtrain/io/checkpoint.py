"""Checkpoints: sharded save, re-sharding load, atomic publish, checksums. No pickle.

A checkpoint is a folder `checkpoints/step_NNNNNNNN/`:

    meta.json               step, config, the placement table, the saving layout, sha256 of every file
    rank_00000.safetensors  pieces of parameters, m and v: "param/<name>/t<r>/<start>" is elements
    rank_00001.safetensors  [start, start+len) of tp rank r's flattened shard of tensor <name>
                            (of a stack of experts: of all E, ep rank k's from k's first expert on)

Every rank writes the elements of the canonical flat space it owns (its shard of each bucket),
so no rank ever holds the whole model state in one file and all write in parallel. Because a
piece is named by (tensor name, tp shard, element offset) and meta.json holds the placement table
(each tensor's full shape and tp split), any layout can find the elements it needs: loading
re-shards to whatever the current mesh, world size, tp degree and ZeRO stage are.

Publishing is atomic: everything is written into `step_N.tmp/`, fsynced, then rank 0 writes
meta.json (with every file's sha256 and size) and renames the folder. A save that fails midway
leaves at most a `.tmp` folder, which nothing reads: one that fails with an error (a full disk)
removes its own at once, and the next successful save removes a killed rank's. A folder without a
valid meta.json, or with a missing, truncated or damaged file, is skipped (with a warning saying
which) for the previous one; nothing is loaded before it verified.

There is no RNG state to save: initialisation draws each parameter from its own seeded generator,
the data order is a pure function of (seed, step), and the model has no dropout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import json
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from braidtrain.errors import SaveFailed, UserError
from braidtrain.model import registry
from braidtrain.parallel import placement

FORMAT = 4  # 4: a layer's experts stacked; 3 (read too): a parameter per expert (Reader maps the names);
# 2 (read too): the table is the model config's


def saved_config(meta: dict):
    """The saved model config (its family: GPT-2 in checkpoints from before families), fields added
    since taking their defaults (a dense model before MoE)."""
    return registry.config_of(meta.get("family", "gpt2"), meta["model"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pieces(engine):
    """(bucket index, key, start, length, bucket position) of each run of a parameter's elements in
    this rank's shard [lo, hi) of its bucket: what this rank writes. The key names the tensor and
    its tp shard, "<name>/t<tp rank>", and start counts in that shard's flattened elements (a stack
    of experts: this ep rank's from its first expert's place on, Table.offset); tp-replicated
    parameters are written by tp rank 0 only, as "<name>/t0"."""
    tp_rank = engine.tp.index
    for i, b in enumerate(engine.buckets):
        for j, (name, _) in enumerate(b.params):
            e = engine.table[name]
            if (e.replicated and tp_rank > 0) or e.copy:  # (a copy is its first stage's)
                continue
            key, first = f"{name}/t{0 if e.replicated else tp_rank}", engine.table.offset(e)
            for elem, pos, n in b.runs(j):
                a, z = max(pos, b.lo), min(pos + n, b.hi)
                if a < z:
                    yield i, key, first + elem + a - pos, z - a, a


def layout_record(lay, world_size: int) -> dict:
    """What meta.json says of the saving layout (and a resume compares with its own)."""
    return {"world_size": world_size, "dp": lay.dp, "zero": lay.zero, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp,
            "cp_impl": lay.cp_impl, "cp_order": lay.cp_order, "ep": lay.ep}


def save(ckpt_dir: Path, step: int, engine, opt, info: dict, rt, lay, keep: int, run_id: str, midway=None) -> float:
    """Collective: every rank calls it. `info` (config, model, tokenizer) goes into meta.json.
    `midway(step)`, if given, runs after this rank's file is written, before anything is published
    (the fault-injection test hook). Returns the seconds it took."""
    t0 = time.time()
    opt.wait()  # (--offload: the last update may still be landing, parallel/offload.py)
    final = ckpt_dir / f"step_{step:08d}"
    tmp = ckpt_dir / f"step_{step:08d}.tmp"
    if rt.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / RUN_MARK).write_text(run_id)  # whose unfinished save this is (rotate)
    world = engine.world
    engine.comm.barrier(world)
    tensors = {}
    for i, name, a, n, pos in pieces(engine):
        b = engine.buckets[i]
        base = pos - engine.owned_range(b)[0]  # (the fp32 master: a lean state's bf16 weights are not saved)
        tensors[f"param/{name}/{a}"] = b.master[base : base + n].detach().cpu().clone()
        m, v, _ = opt.groups[i]
        tensors[f"m/{name}/{a}"] = m[base : base + n].cpu().clone()
        tensors[f"v/{name}/{a}"] = v[base : base + n].cpu().clone()
    fname = f"rank_{rt.rank:05d}.safetensors"
    path = tmp / fname
    digest, failed = None, None
    try:
        save_file(tensors, str(path))
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        digest = _sha256(path), path.stat().st_size
        if midway is not None:
            midway(step)
    except (OSError, SafetensorError) as e:  # a full disk, a quota, a file-size limit: every rank learns of it
        # below (safetensors reports an I/O error as its own, "... I/O error: No space left on device ...")
        failed = f"rank {rt.rank} could not write checkpoint {final}: {getattr(e, 'strerror', None) or e}"
    sums = engine.comm.all_gather_object((fname, digest, failed), world)
    failed = next((f for _, _, f in sums if f), None)
    if failed:  # nothing was published: the previous checkpoint, if any, stands
        if rt.is_main:  # (every rank is past its writes) what was written goes: it would only hold space
            shutil.rmtree(tmp, ignore_errors=True)
        before = list_checkpoints(ckpt_dir)
        raise SaveFailed(failed + (f" (the previous checkpoint is intact: {before[-1].name}; its partial files "
                                   f"were removed; free space, then --resume auto)" if before else
                                   " (its partial files were removed; there is no earlier checkpoint: free space, "
                                   "then run again)"))
    if rt.is_main:
        meta = {
            "format": FORMAT,
            "step": step,
            "optimizer_step": opt.step_count,
            "run": run_id,
            **info,
            "placement": placement.for_config(engine.model.cfg).to_json(),  # every parameter's, whatever the stage
            "layout": layout_record(lay, rt.world_size),
            "files": {f: d[0] for f, d, _ in sums},
            "sizes": {f: d[1] for f, d, _ in sums},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        with open(tmp / "meta.json", "rb+") as f:
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        rotate(ckpt_dir, keep, run_id)
    engine.comm.barrier(world)
    return time.time() - t0


RUN_MARK = "run"  # in a step_N.tmp folder: the id of the run whose save it is


def run_of(path: Path) -> str | None:
    """The run id a checkpoint (or an unfinished save) records; None: unreadable, or from before ids."""
    try:
        if path.name.endswith(".tmp"):
            return (path / RUN_MARK).read_text().strip()
        return json.loads((path / "meta.json").read_text()).get("run")
    except (OSError, ValueError):
        return None


def rotate(ckpt_dir: Path, keep: int, run_id: str) -> None:
    """Delete this run's checkpoints but the newest `keep`, and what its failed saves left --
    never another run's (a checkpoint of no id is from before ids: the run that resumed it)."""
    mine = [p for p in list_checkpoints(ckpt_dir) if run_of(p) in (run_id, None)]
    for old in mine[:-keep] + [p for p in ckpt_dir.glob("step_*.tmp") if run_of(p) == run_id]:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))


def verify(path: Path) -> dict:
    """meta.json of a complete, undamaged checkpoint, or UserError saying what is wrong."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise UserError(f"checkpoint {path} is incomplete (no meta.json)")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise UserError(f"checkpoint {path}: meta.json is damaged") from None
    if meta.get("format") not in (2, 3, FORMAT):
        raise UserError(f"checkpoint {path}: unknown format {meta.get('format')}")
    sizes = meta.get("sizes", {})
    for fname, digest in meta["files"].items():
        f = path / fname
        if not f.is_file():
            raise UserError(f"checkpoint {path}: {fname} is missing")
        if f.stat().st_size < sizes.get(fname, 0):
            raise UserError(f"checkpoint {path}: {fname} is truncated ({f.stat().st_size} of {sizes[fname]} bytes)")
        if _sha256(f) != digest:
            raise UserError(f"checkpoint {path}: {fname} does not match its checksum (damaged or truncated)")
    return meta


def find_resume(spec: str, ckpt_dir: Path, warn) -> Path | None:
    """`auto`: the newest checkpoint that verifies (damaged ones are skipped with a warning);
    otherwise the given folder, which must verify."""
    if spec != "auto":
        path = Path(spec)
        if not path.exists():
            raise UserError(f"no checkpoint at {path} (--resume takes a checkpoint folder, e.g. "
                            f"RUN/checkpoints/step_00000100, or auto)")
        verify(path)
        return path
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            verify(path)
            return path
        except UserError as e:
            warn(f"warning: skipping {e}")
    return None


def load(path: Path, engine, opt) -> dict:
    """Fill this rank's parameters (all of them, or its ZeRO-3 shard; bf16 ones rounded from the
    saved fp32), fp32 master and optimizer state (its shard) from a checkpoint saved by any layout:
    any world size, ZeRO stage or tp degree, an fp32 or a lean state, with or without offload."""
    meta = json.loads((path / "meta.json").read_text())
    family, mine = meta.get("family", "gpt2"), engine.model.cfg.family
    if family != mine:
        raise UserError(f"checkpoint {path} holds a {family} model and this run builds a {mine} one: resume it with "
                        f"a {family} --model (or give another --out)")
    behaviour = ("moe_top_k", "moe_capacity", "moe_aux")  # the routing's settings: the parameters are the same
    saved = {k: v for k, v in dataclasses.asdict(saved_config(meta)).items() if k not in behaviour}
    want = {k: v for k, v in dataclasses.asdict(engine.model.cfg).items() if k not in behaviour}
    if saved != want:
        diff = {k: (saved.get(k), v) for k, v in want.items() if saved.get(k) != v}
        if saved.get("moe_experts") != want["moe_experts"] and 0 in (saved.get("moe_experts"), want["moe_experts"]):
            kind = ("an MoE", "a dense") if saved.get("moe_experts") else ("a dense", "an MoE")
            raise UserError(f"checkpoint {path} holds {kind[0]} model and this run builds {kind[1]} one: use "
                            f"the checkpoint's --moe-experts {saved.get('moe_experts')}")
        raise UserError(f"checkpoint {path} was saved from a different model ({diff} saved vs now): "
                        "use the same model config")
    read = Reader(path, meta, engine.table)
    with torch.no_grad():
        for i, b in enumerate(engine.buckets):
            m, v, _ = opt.groups[i]
            lo, hi = engine.owned_range(b)
            plo = b.lo if b.zero == 3 else 0  # where b.data starts in the bucket
            for j, (name, _) in enumerate(b.params):
                first = engine.table.offset(engine.table[name])
                for elem, pos, n in b.runs(j):  # (elements first + elem + k are at pos + k)
                    at = first + elem - pos
                    a, e = max(pos, plo), min(pos + n, plo + b.data.numel())
                    if a < e:
                        b.data[a - plo : e - plo].copy_(read("param", name, at + a, at + e))
                    a, e = max(pos, lo), min(pos + n, hi)
                    if a < e:
                        if b.apart:  # (else the master is the compute weights just written)
                            b.master[a - lo : e - lo].copy_(read("param", name, at + a, at + e))
                        m[a - lo : e - lo].copy_(read("m", name, at + a, at + e))
                        v[a - lo : e - lo].copy_(read("v", name, at + a, at + e))
    opt.step_count = meta["optimizer_step"]
    return meta


class Reader:
    """Elements [a, e) of this rank's (flattened) tensor `name`, from whichever rank files hold
    them. Saved with the same tp degree: read straight from the pieces of this tp rank's shard.
    Saved with another: the full tensor from the saved tp shards, then this rank's shard of it
    (placement.Placed.unshard and .shard: the padding of a split dim is cut and added there).
    `table`: this layout's placement table (None: one process, tp = 1)."""

    def __init__(self, path: Path, meta: dict, table=None):
        if "placement" in meta:
            self.saved = placement.Table.from_json(meta["placement"])
        else:  # format 2: the table of the model config, at tp = 1 (the layout is meta's)
            self.saved = placement.for_config(saved_config(meta))
        self.saved_tp = meta["layout"].get("tp", 1)
        self.tp, self.tp_rank = (table.tp, table.tp_rank) if table is not None else (1, 0)
        self.stacks: dict[str, list[str]] = {}  # format 3: a stacked parameter's per-expert tensors, in order
        for e in self.saved if meta.get("format") == 3 else ():
            if e.expert:
                self.stacks.setdefault(placement.stacked_name(e.name)[0], []).append(e.name)
        for names in self.stacks.values():
            names.sort(key=lambda n: placement.stacked_name(n)[1])
        self.index: dict[str, list[tuple[int, str, str]]] = {}  # "<name>/t<r>" -> [(start, file, key rest)]
        self.handles, self.cache = {}, {}
        for fname in meta["files"]:
            h = self.handles[fname] = safe_open(str(path / fname), framework="pt")
            for key in h.keys():
                kind, rest = key.split("/", 1)
                if kind == "param":
                    tensor, start = rest.rsplit("/", 1)
                    self.index.setdefault(tensor, []).append((int(start), fname, rest))

    def _pieces(self, kind, tensor, a, e) -> torch.Tensor:
        out = torch.empty(e - a)
        for start, fname, rest in self.index[tensor]:
            t = self.handles[fname].get_slice(f"{kind}/{rest}")
            lo, hi = max(a, start), min(e, start + t.get_shape()[0])
            if lo < hi:
                out[lo - a : hi - a] = t[lo - start : hi - start]
        return out

    def full(self, kind: str, name: str) -> torch.Tensor:
        """The whole unsharded tensor, in its full (tp = 1) shape."""
        if name in self.stacks:  # (saved a tensor per expert)
            return torch.stack([self.full(kind, n) for n in self.stacks[name]])
        e = self.saved[name]
        if e.replicated:
            return self._pieces(kind, f"{name}/t0", 0, math.prod(e.shape)).view(e.shape)
        local = e.local_shape(self.saved_tp)
        return e.unshard([self._pieces(kind, f"{name}/t{r}", 0, math.prod(local)).view(local)
                          for r in range(self.saved_tp)])

    def __call__(self, kind: str, name: str, a: int, e: int) -> torch.Tensor:
        entry = self.saved.by_name.get(name)
        if entry is not None and entry.replicated:
            return self._pieces(kind, f"{name}/t0", a, e)
        if entry is not None and self.saved_tp == self.tp:
            return self._pieces(kind, f"{name}/t{self.tp_rank}", a, e)
        if (kind, name) not in self.cache:  # (kept: the parameter's, m's and v's, until the next parameter)
            full = self.full(kind, name)  # (a stack of per-expert tensors: replicated over tp, as experts are)
            self.cache = {k: t for k, t in self.cache.items() if k[1] == name}
            self.cache[kind, name] = (full if entry is None else entry.shard(full, self.tp_rank, self.tp)).reshape(-1)
        return self.cache[(kind, name)][a:e]


def load_params(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Every full parameter of a checkpoint (for sampling and export, in one process), and its meta."""
    meta = verify(path)
    read = Reader(path, meta)
    return {e.name: read.full("param", e.name) for e in placement.for_config(saved_config(meta))}, meta


def load_model(path: Path):
    """The whole model of a checkpoint (one process, tp = 1) with its parameters, and its meta."""
    params, meta = load_params(path)
    model = registry.build(saved_config(meta))
    model.load_state_dict(params)
    return model, meta


def latest(run: Path) -> Path:
    """The newest valid checkpoint of a run directory, or UserError."""
    path = find_resume("auto", Path(run) / "checkpoints", lambda msg: print(msg))
    if path is None:
        raise UserError(f"{run}: no valid checkpoint under {run}/checkpoints")
    return path


def weights_sha256(engine) -> str:
    """A sha256 of the weights that does not depend on the layout: over the sha256 of every
    parameter's full fp32 bytes -- its fp32 master's, in a lean state: gathered where sharded --
    (Placed.unshard: under tp the shards are gathered, collective over the tp group, and joined
    into the tp = 1 shape), in the whole model's named_parameters order.
    Each pipeline stage (and ep rank: its experts) hashes its own parameters; the digests meet over
    the pp group (the world under ep). A stack of experts is hashed expert by expert, in the order
    of the model with a parameter per expert (placement.per_expert): the hash of the same weights
    before experts were stacked. Under ZeRO-3 the parameters are gathered for it (collective over
    the replica group)."""
    tp = engine.tp
    mine = {}
    with engine.gathered():
        master = {}  # parameter -> its fp32 values, shaped as it
        for b in engine.buckets:
            whole = engine.master_whole(b)
            master.update({p: v for p, v in b.views(whole)})
        for part in engine.parts:
            for name, p in part.named_parameters():
                e, t = engine.table[name], master[p].detach().float()
                if tp.size > 1 and not e.replicated:
                    rows = engine.comm.gather_rows(t.contiguous().reshape(-1), tp)
                    t = e.unshard([r.view(t.shape) for r in rows])
                for i, piece in zip(engine.table.held(e), t if e.expert else [t]):  # (each expert's slice)
                    if not e.copy:  # (a copy of the bytes: numpy pins storage)
                        digest = hashlib.sha256(piece.cpu().clone().numpy().tobytes()).hexdigest()
                        mine[name, i if e.expert else None] = digest
    digests = {}  # each stage's, each ep rank's experts
    for d in engine.comm.all_gather_object(mine, engine.world if engine.ep.size > 1 else engine.pp):
        digests.update(d)
    order = placement.per_expert(placement.for_config(engine.model.cfg))
    return hashlib.sha256("".join(digests[e.name, i] for e, i in order).encode()).hexdigest()
