"""Multiple-choice evaluation (HellaSwag-style) in llm.c's eval file format.

The file (llm.c's dev/data/data_common.py, write_evalfile): a header of 256 little-endian int32
-- 20240522, version 1, the number of examples, the longest example's byte length -- then each
example as a run of uint16:

    65535, this record's bytes (all its fields), index, label, completions, n_ctx, ctx tokens...,
    then per completion: n, its tokens...

Each completion is scored by the model's log-likelihood of its tokens given the context: its mean
over the completion's tokens picks llm.c's answer (`eval_acc`), the sum a second one
(`eval_acc_sum`). Examples are dealt to the data-parallel ranks (rank r: r, r + dp, ...), every
rank runs the same number of passes of the same shape (padded; the model-parallel ranks of a
replica -- tp, pp, cp, ep -- step through them together), and the correct counts are summed over
the ranks (Comm.ordered_sum): whole numbers, so the same on any world size.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from braidtrain.collective.comm import Comm
from braidtrain.collective.mesh import build_mesh
from braidtrain.collective.runtime import init_runtime
from braidtrain.errors import UserError
from braidtrain.io import paths
from braidtrain.io.checkpoint import load_model
from braidtrain.io.data import get_tokenizer, tokenizer_for
from braidtrain.io.export import checkpoint_of

MAGIC, VERSION, HEADER_INTS = 20240522, 1, 256
DELIM = 65535
PER_PASS = 4  # examples per forward pass (their completions are its rows)


@dataclass
class Example:
    index: int
    label: int
    context: list[int]
    endings: list[list[int]]


def read_evalfile(path) -> list[Example]:
    """Every example of an llm.c eval file, each record checked against its own byte count."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read eval file {path}: {e.strerror or e}") from None
    if len(raw) < 4 * HEADER_INTS or len(raw) % 2:
        raise UserError(f"{path} is truncated or not an llm.c eval file ({len(raw)} bytes)")
    magic, version, count = (int(v) for v in np.frombuffer(raw[: 4 * HEADER_INTS], "<i4")[:3])
    if magic != MAGIC:
        hint = ": it is a token file (-i/-j)" if magic == 20240520 else ""
        raise UserError(f"{path} is not an llm.c eval file (magic {magic}, expected {MAGIC}){hint}")
    if version != VERSION:
        raise UserError(f"{path} has eval file version {version}, expected {VERSION}")
    s = np.frombuffer(raw[4 * HEADER_INTS :], "<u2").tolist()
    out, pos = [], 0
    for i in range(count):
        where = f"{path}: example {i} (at byte {4 * HEADER_INTS + 2 * pos})"
        if pos + 6 > len(s) or s[pos] != DELIM:
            raise UserError(f"{where}: {'the file ends' if pos + 6 > len(s) else 'no 65535 delimiter'} "
                            f"where the header announces {count} examples (truncated or corrupt)")
        nbytes, index, label, n, n_ctx = s[pos + 1 : pos + 6]
        rec = s[pos : pos + nbytes // 2]
        q = 6 + n_ctx
        context, endings = rec[6:q], []
        for _ in range(n):
            k = rec[q] if q < len(rec) else 0
            endings.append(rec[q + 1 : q + 1 + k])
            q += 1 + k
        if nbytes % 2 or pos + nbytes // 2 > len(s) or q != len(rec):
            raise UserError(f"{where}: its fields take {2 * q} bytes but it says {nbytes} (truncated or corrupt)")
        out.append(Example(index, label, context, endings))
        check_example(out[-1], where)
        pos += len(rec)
    if pos != len(s):
        raise UserError(f"{path}: {2 * (len(s) - pos)} bytes after the {count} examples the header announces")
    if not out:
        raise UserError(f"{path} holds no examples")
    return out


def check_example(ex: Example, where: str) -> None:
    if not ex.endings:
        raise UserError(f"{where}: no completions")
    if not 0 <= ex.label < len(ex.endings):
        raise UserError(f"{where}: label {ex.label} is not one of its {len(ex.endings)} completions "
                        f"(0..{len(ex.endings) - 1})")
    if not ex.context:
        raise UserError(f"{where}: no context tokens (the first completion token would have nothing to follow)")
    if not all(ex.endings):
        raise UserError(f"{where}: a completion has no tokens")


def write_evalfile(path, examples: list[Example]) -> None:
    """llm.c's layout (indices 0, 1, ...), written atomically."""
    path = Path(path)
    if len(examples) >= 2**16:
        raise UserError(f"{path}: {len(examples)} examples; the format's uint16 index holds at most 65535")
    stream, longest = [], 0
    for i, ex in enumerate(examples):
        rec = [DELIM, 0, i, ex.label, len(ex.endings), len(ex.context), *ex.context]
        for e in ex.endings:
            rec += [len(e), *e]
        if any(not 0 <= t < DELIM for t in ex.context + sum(ex.endings, [])):
            raise UserError(f"{path}: example {i} has a token outside 0..65534")
        if 2 * len(rec) >= 2**16:
            raise UserError(f"{path}: example {i} takes {2 * len(rec)} bytes; the format's uint16 length holds at most "
                            "65535")
        rec[1] = 2 * len(rec)
        longest = max(longest, rec[1])
        stream += rec
    header = np.zeros(HEADER_INTS, "<i4")
    header[:4] = MAGIC, VERSION, len(examples), longest
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(stream, "<u2").tobytes())
    os.replace(tmp, path)


def prepare(jsonl, out, tokenizer: str = "gpt2") -> dict:
    """`data prepare-eval`: lines of {"context", "endings", "label"} -> an eval file. Each ending is
    tokenized as it follows the context, after a space (llm.c's " " + ending). `tokenizer`: a name
    or a data folder (its tokenizer.json; none: gpt2, like llm.c's files)."""
    if Path(tokenizer).is_dir():
        tokenizer = tokenizer_for([Path(tokenizer) / "_"]) or "gpt2"
    tok = get_tokenizer(tokenizer)
    try:
        lines = Path(jsonl).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {jsonl}: {getattr(e, 'strerror', None) or e}") from None
    examples = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{jsonl}:{no}"
        try:
            d = json.loads(line)
        except ValueError as e:
            raise UserError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(d, dict) or not {"context", "endings", "label"} <= set(d):
            raise UserError(f'{where}: expected an object with "context", "endings" and "label"')
        ctx, ends, label = d["context"], d["endings"], d["label"]
        if not isinstance(ctx, str) or not isinstance(ends, list) or not all(isinstance(e, str) for e in ends):
            raise UserError(f'{where}: "context" must be a string and "endings" a list of strings')
        if not isinstance(label, int) or isinstance(label, bool):
            raise UserError(f'{where}: "label" must be an integer, got {label!r}')
        ex = Example(len(examples), label, tok.encode(ctx), [tok.encode(" " + e) for e in ends])
        check_example(ex, where)
        examples.append(ex)
    if not examples:
        raise UserError(f"{jsonl}: no examples")
    write_evalfile(out, examples)
    return {"examples": len(examples), "tokenizer": tok.name, "out": str(out)}


# ----------------------------------------------------------------------------- scoring


def _rows(ex: Example, limit: int, vocab: int) -> list[tuple[list[int], list[int], int]]:
    """Each completion's (inputs, targets, completion length): context + completion, the oldest
    context tokens dropped where the row is longer than the model's context."""
    rows = []
    for e in ex.endings:
        if len(e) > limit:
            raise UserError(f"eval example {ex.index}: a completion of {len(e)} tokens is longer than the model's "
                            f"context ({limit})")
        full = (ex.context + e)[-(limit + 1) :]
        if max(full) >= vocab:
            raise UserError(f"eval example {ex.index}: token {max(full)} is outside the model's vocabulary of {vocab} "
                            f"(was the eval file made with another tokenizer? data prepare-eval --tokenizer)")
        rows.append((full[:-1], full[1:], len(e)))
    return rows


def check_tokens(examples: list[Example], vocab: int, block_size: int | None = None) -> None:
    """Every example fits the model (a UserError naming the first that does not): its tokens in the
    vocabulary -- an eval file of another tokenizer -- and, block_size given, each completion in the
    context."""
    for ex in examples:
        _rows(ex, block_size or 2**31, vocab)


@torch.no_grad()
def score(logits_of, examples: list[Example], *, rank: int = 0, world: int = 1, block_size: int, vocab: int,
          device="cpu", mult: int = 1, keep: bool = True, progress: bool = False) -> list[int]:
    """[correct by mean, correct by sum] over this rank's examples (rank, rank + world, ...).
    `logits_of(x)`: (B, T, V) logits of token ids x (B, T), or None on a rank without the head.
    Every rank makes the same number of calls with the same shape (T: the file's longest row,
    rounded up to `mult`); `keep` False: this rank's counts are another's copy (tp, cp)."""
    limit = block_size // mult * mult
    every = [_rows(ex, limit, vocab) for ex in examples]  # (checked on every rank: all fail alike)
    mine = every[rank::world]
    longest = max(len(inp) for rows in every for inp, _, _ in rows)
    T, R = -(-longest // mult) * mult, PER_PASS * max(len(ex.endings) for ex in examples)
    passes = math.ceil(math.ceil(len(examples) / world) / PER_PASS)
    steps = range(passes)
    if progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc="eval", unit="pass", leave=False)
    correct = [0, 0]
    for p in steps:
        chunk = mine[p * PER_PASS : (p + 1) * PER_PASS]
        x, y = torch.zeros((2, R, T), dtype=torch.long)
        mask = torch.zeros((R, T), dtype=torch.bool)
        r = 0
        for rows in chunk:
            for inp, tgt, n in rows:
                x[r, : len(inp)], y[r, : len(tgt)] = torch.tensor(inp), torch.tensor(tgt)
                mask[r, len(tgt) - n : len(tgt)] = True
                r += 1
        logits = logits_of(x.to(device))
        if logits is None or not keep:
            continue
        lp = torch.log_softmax(logits.float(), -1).gather(-1, y.to(device)[..., None])[..., 0].double().cpu()
        sums = torch.where(mask, lp, 0.0).sum(1).tolist()
        r = 0
        for ex, rows in zip(examples[rank::world][p * PER_PASS :], chunk):
            s = sums[r : r + len(rows)]
            mean = [v / n for v, (_, _, n) in zip(s, rows)]
            correct[0] += max(range(len(s)), key=mean.__getitem__) == ex.label  # (ties: the first)
            correct[1] += max(range(len(s)), key=s.__getitem__) == ex.label
            r += len(rows)
    return correct


def totals(correct: list[int], n: int, ranks_sum=float) -> dict:
    """The accuracies from every rank's counts (ranks_sum: a count's sum over the ranks)."""
    c = [int(ranks_sum(v)) for v in correct]
    return {"eval_acc": c[0] / n, "eval_acc_sum": c[1] / n, "eval_correct": c[0], "eval_correct_sum": c[1], "eval_n": n}


def in_training(trainer) -> dict:
    """The run's model on trainer.mc's examples, through the forward-only pass that sampling uses
    (every layout: ZeRO-3's parameters gathered, tp's logits whole on every tp rank, cp's ranks each
    the whole row, the pipeline's last stage the logits)."""
    t, mesh, lay = trainer, trainer.mesh, trainer.layout
    for part in t.parts:
        part.eval()
    with t.engine.gathered():
        correct = score(t.passes.next_logits, t.mc, rank=mesh.coord("dp"), world=lay.dp, block_size=t.mcfg.block_size,
                        vocab=t.mcfg.vocab_size, device=t.device, mult=lay.tp if lay.sp else 1,
                        keep=mesh.coord("tp") == 0 and mesh.coord("cp") == 0)
    for part in t.parts:
        part.train()
    world = mesh.groups["world"]
    return totals(correct, len(t.mc), lambda v: t.comm.ordered_sum(v, world))


def run(args) -> int:
    """`braidtrain eval RUN --eval-data FILE`: the run's newest checkpoint (or RUN, a checkpoint
    folder), on one process or over torchrun's ranks; rank 0 prints and writes RUN/eval.json.
    Every path and the examples against the model are checked before the model is scored."""
    ckpt = checkpoint_of(args.run)
    run_dir = Path(args.run)
    out = paths.out_file(args.out or (run_dir if ckpt != run_dir else ckpt.parent.parent) / "eval.json", "--out")
    examples = read_evalfile(paths.in_file(args.eval_data, "--eval-data"))
    model, meta = load_model(ckpt)
    check_tokens(examples, model.cfg.vocab_size, model.cfg.block_size)
    rt = init_runtime("env", device=args.device)
    done = False
    try:
        comm = Comm(rt.device)
        world = build_mesh(rt.rank, rt.world_size, comm).groups["world"]
        model.to(rt.device).eval()
        cast = torch.autocast("cuda", torch.bfloat16) if rt.device.type == "cuda" else nullcontext()

        def logits_of(x):
            with cast:
                return model(x)

        correct = score(logits_of, examples, rank=rt.rank, world=rt.world_size, block_size=model.cfg.block_size,
                        vocab=model.cfg.vocab_size, device=rt.device, progress=args.progress and rt.is_main)
        res = {"checkpoint": str(ckpt), "step": meta.get("step"), "eval_data": str(args.eval_data),
               **totals(correct, len(examples), lambda v: comm.ordered_sum(v, world))}
        if rt.is_main:
            print(f"eval_acc {res['eval_acc']:.4f} ({res['eval_correct']}/{len(examples)}, mean log-likelihood)")
            print(f"eval_acc_sum {res['eval_acc_sum']:.4f} ({res['eval_correct_sum']}/{len(examples)}, summed "
                  "log-likelihood)")
            out.write_text(json.dumps(res, indent=1) + "\n")
            print(f"wrote {out}")
        done = True
    finally:
        rt.close(clean=done)
    return 0
