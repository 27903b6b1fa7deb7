"""Checkpoints: sharded save, re-sharding load, atomic publish, checksums. No pickle.

A checkpoint is a folder `checkpoints/step_NNNNNNNN/`:

    meta.json               step, config, model shapes, the saving layout, sha256 of every file
    rank_00000.safetensors  pieces of parameters, m and v: "param/<name>/<start>" is elements
    rank_00001.safetensors  [start, start+len) of the flattened full tensor <name>

Every rank writes the elements of the canonical flat space it owns (its shard of each bucket),
so no rank ever holds the whole model state in one file and all write in parallel. Because a
piece is named by (tensor name, element offset), any layout can find the elements it needs:
loading re-shards to whatever the current mesh, world size and ZeRO stage are.

Publishing is atomic: everything is written into `step_N.tmp/`, fsynced, then rank 0 writes
meta.json (with every file's sha256 and size) and renames the folder. A save that fails midway (a
full disk, a killed rank) leaves only a `.tmp` folder, which nothing reads and the next successful
save removes. A folder without a valid meta.json, or with a missing, truncated or damaged file, is
skipped (with a warning saying which) for the previous one; nothing is loaded before it verified.

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
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from braidtrain.errors import UserError
from braidtrain.model.layers import shard_of, unshard

FORMAT = 2


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
    """(bucket index, key, start, end, bucket position) for the elements of each parameter that
    fall in this rank's shard [lo, hi) of its bucket: what this rank writes. The key names the
    tensor and its tp shard, "<name>/t<tp rank>"; tp-replicated parameters are written by tp
    rank 0 only, as "<name>/t0"."""
    for i, b in enumerate(engine.buckets):
        for (name, p), off in zip(b.params, b.offsets):
            if name in engine.replicated and engine.tp_rank > 0:
                continue
            tag = 0 if name in engine.replicated else engine.tp_rank
            a, e = max(off, b.lo), min(off + p.numel(), b.hi)
            if a < e:
                yield i, f"{name}/t{tag}", a - off, e - off, a


def save(ckpt_dir: Path, step: int, engine, opt, info: dict, model_shapes: dict, rt, keep: int,
         midway=None) -> float:
    """Collective: every rank calls it. `info` (config, model, tokenizer) goes into meta.json.
    `midway(step)`, if given, runs after this rank's file is written, before anything is published
    (the fault-injection test hook). Returns the seconds it took."""
    t0 = time.time()
    final = ckpt_dir / f"step_{step:08d}"
    tmp = ckpt_dir / f"step_{step:08d}.tmp"
    if rt.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    engine.comm.sync("barrier", "world", rt.barrier)
    tensors = {}
    for i, name, a, e, pos in pieces(engine):
        b = engine.buckets[i]
        data = pos - (b.lo if engine.zero == 3 else 0)  # ZeRO-3 holds only the shard
        tensors[f"param/{name}/{a}"] = b.data[data : data + e - a].detach().cpu().clone()
        m, v, _ = opt.groups[i]
        base = pos - engine.owned_range(b)[0]
        tensors[f"m/{name}/{a}"] = m[base : base + e - a].cpu().clone()
        tensors[f"v/{name}/{a}"] = v[base : base + e - a].cpu().clone()
    fname = f"rank_{rt.rank:05d}.safetensors"
    path = tmp / fname
    try:
        save_file(tensors, str(path))
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        digest = _sha256(path), path.stat().st_size
        if midway is not None:
            midway(step)
    except OSError as e:  # a full disk, a quota: nothing was published, the previous checkpoint stands
        raise UserError(f"rank {rt.rank} could not write checkpoint {final}: {e.strerror or e} "
                        f"(the previous checkpoint is intact; free space, then --resume auto)") from None
    sums = [None] * rt.world_size
    if rt.world_size > 1:
        engine.comm.sync("all_gather_object", "world", lambda: dist.all_gather_object(sums, (fname, digest)))
    else:
        sums = [(fname, digest)]
    if rt.is_main:
        meta = {
            "format": FORMAT,
            "step": step,
            "optimizer_step": opt.step_count,
            **info,
            "shapes": {k: list(v) for k, v in model_shapes.items()},
            "layout": {"world_size": rt.world_size, "dp": engine.n, "zero": engine.zero, "tp": engine.tp},
            "files": {f: d[0] for f, d in sums},
            "sizes": {f: d[1] for f, d in sums},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        with open(tmp / "meta.json", "rb+") as f:
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        for old in sorted(list_checkpoints(ckpt_dir))[:-keep] + list(ckpt_dir.glob("step_*.tmp")):
            shutil.rmtree(old, ignore_errors=True)  # old checkpoints, and what failed saves left
    engine.comm.sync("barrier", "world", rt.barrier)
    return time.time() - t0


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
    if meta.get("format") != FORMAT:
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
        verify(path)
        return path
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            verify(path)
            return path
        except UserError as e:
            warn(f"warning: skipping {e}")
    return None


def load(path: Path, engine, opt, model) -> dict:
    """Fill this rank's parameters (all of them, or its ZeRO-3 shard) and optimizer state (its
    shard) from a checkpoint saved by any layout: any world size, ZeRO stage or tp degree."""
    meta = json.loads((path / "meta.json").read_text())
    want = dataclasses.asdict(model.cfg)
    if meta["model"] != want:
        diff = {k: (meta["model"].get(k), v) for k, v in want.items() if meta["model"].get(k) != v}
        raise UserError(f"checkpoint {path} was saved from a different model ({diff} saved vs now): "
                        "use the same model config")
    read = Reader(path, meta, model)
    with torch.no_grad():
        for i, b in enumerate(engine.buckets):
            m, v, _ = opt.groups[i]
            lo, hi = engine.owned_range(b)
            plo = b.lo if engine.zero == 3 else 0  # where b.data starts in the bucket
            for (name, p), off in zip(b.params, b.offsets):
                a, e = max(off, plo), min(off + p.numel(), plo + b.data.numel())
                if a < e:
                    b.data[a - plo : e - plo].copy_(read("param", name, a - off, e - off))
                a, e = max(off, lo), min(off + p.numel(), hi)
                if a < e:
                    m[a - lo : e - lo].copy_(read("m", name, a - off, e - off))
                    v[a - lo : e - lo].copy_(read("v", name, a - off, e - off))
    opt.step_count = meta["optimizer_step"]
    return meta


class Reader:
    """Elements [a, e) of this rank's (flattened) tensor `name`, from whichever rank files hold
    them. Saved with the same tp degree: read straight from the pieces of this tp rank's shard.
    Saved with another: rebuild the full tensor from the saved tp shards (model/layers.unshard),
    fit the vocabulary padding of wte to this layout (the padding rows are zeros beyond the tp=1
    padding, and never trained), and cut this rank's shard (shard_of)."""

    def __init__(self, path: Path, meta: dict, model=None):
        from braidtrain.model.gpt import GPTConfig, shard_spec

        self.meta, self.spec = meta, shard_spec
        self.saved_tp = meta["layout"].get("tp", 1)
        self.tp, self.tp_rank = (model.tp, model.tp_rank) if model is not None else (1, 0)
        cfg = model.cfg if model is not None else GPTConfig(**meta["model"])
        self.rows = cfg.vocab_rows(self.tp)  # wte rows in this layout
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

    def full(self, kind: str, name: str, rows: int | None = None) -> torch.Tensor:
        """The whole unsharded tensor (wte with `rows` rows of vocabulary, if given)."""
        spec, shape = self.spec(name), self.meta["shapes"][name]
        n = math.prod(shape)
        if spec.kind == "replicated":
            return self._pieces(kind, f"{name}/t0", 0, n).view(shape)
        parts = [self._pieces(kind, f"{name}/t{r}", 0, n).view(shape) for r in range(self.saved_tp)]
        full = unshard(parts, spec)
        if rows is not None and full.shape[0] != rows:  # wte: fit the vocabulary padding
            fitted = full.new_zeros(rows, *full.shape[1:])
            k = min(rows, full.shape[0])
            fitted[:k] = full[:k]
            full = fitted
        return full

    def __call__(self, kind: str, name: str, a: int, e: int) -> torch.Tensor:
        spec = self.spec(name)
        if spec.kind == "replicated":
            return self._pieces(kind, f"{name}/t0", a, e)
        if self.saved_tp == self.tp:
            return self._pieces(kind, f"{name}/t{self.tp_rank}", a, e)
        if (kind, name) not in self.cache:
            full = self.full(kind, name, self.rows if name == "wte.weight" else None)
            self.cache = {(kind, name): shard_of(full, spec, self.tp_rank, self.tp).reshape(-1)}
        return self.cache[(kind, name)][a:e]


def load_params(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Every full parameter of a checkpoint (for sampling and export, in one process), and its meta."""
    meta = verify(path)
    read = Reader(path, meta)
    return {name: read.full("param", name, read.rows if name == "wte.weight" else None)
            for name in meta["shapes"]}, meta


def latest(run: Path) -> Path:
    """The newest valid checkpoint of a run directory, or UserError."""
    path = find_resume("auto", Path(run) / "checkpoints", lambda msg: print(msg))
    if path is None:
        raise UserError(f"{run}: no valid checkpoint under {run}/checkpoints")
    return path


def weights_sha256(model) -> str:
    """sha256 over every full parameter as fp32 bytes, in canonical (named_parameters) order.
    Under tp the shards are gathered and joined first (collective over the tp group), and wte is
    cut to the tp=1 vocabulary padding, so the hash does not depend on the layout."""
    h = hashlib.sha256()
    tp = getattr(model, "tp", 1)
    for name, p in model.named_parameters():
        t = p.detach().float()
        spec = model.shard_spec(name) if tp > 1 else None
        if spec is not None and spec.kind != "replicated":
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=model.group)
            t = unshard(parts, spec)
        if name == "wte.weight":
            t = t[: model.cfg.padded_vocab]
        h.update(t.cpu().clone().numpy().tobytes())  # a copy: numpy pins storage
    return h.hexdigest()
