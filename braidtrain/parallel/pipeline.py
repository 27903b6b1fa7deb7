"""Pipeline parallelism: the split of the model into stages, and the schedules, as data.

The model's blocks are cut into pp * v chunks (v = virtual stages per rank; 1 but for the
interleaved schedule); chunk c lives on pipeline rank c % pp, so rank r holds chunks r, r + pp, ...
The first chunk also holds the embeddings, the last the final LayerNorm, the head and the loss.

    pp = 2, v = 2, 8 blocks:    rank 0: chunk 0 (embeddings, h.0-1), chunk 2 (h.4-5)
                                rank 1: chunk 1 (h.2-3),            chunk 3 (h.6-7, head, loss)

A schedule is, for every rank at once, the order of its chunks' work on the step's m
micro-batches (Narayanan et al. 2021 for 1F1B and interleaving; Qi et al. 2023 for zero bubble):

    gpipe        all forwards, then all backwards                        bubble (p-1)/(m+p-1)
    1f1b         p-r-1 forwards to warm up, then one forward and one     the same bubble, at most
                 backward in turn, then the backwards left               p-r micro-batches alive
    interleaved  1f1b over v chunks a rank, micro-batches in groups of   the bubble / v
                 p, each group through chunk 0, then chunk 1, ...
    zb           1f1b with each backward split into B (the input's       (p-1)(F+B-W) of time, a
                 gradient, on the critical path) and W (the weights'),   third of 1f1b's when
                 rank r's first r W deferred to the cool-down (ZB-H1)    F = B = W

`with_p2p` then places the transfers: a receive right before the work that needs it, a send
right after the work that made it. Each direction between two ranks has a process group of its
own (mesh.py), so NCCL's stream for it carries one direction only: a send never queues behind a
receive, sends need not wait, and only receives block. `check` runs the whole plan before anything
is sent: sends and receives pair up in order on every direction (the k-th send from a to b is the
k-th receive at b from a, of the same tensor), and a simulation -- a receive completes once its
send was posted -- ends with every rank done: no deadlock.
"""

from __future__ import annotations

import functools

from braidtrain.errors import UserError
from braidtrain.parallel.actions import Action

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


# -- the split ----------------------------------------------------------------------------------

def split(n_layer: int, chunks: int, cost=None, by_hand: list[int] | None = None) -> list[range]:
    """The blocks of each chunk: `by_hand` (blocks per chunk), or cut so that the costliest
    chunk costs least. `cost(c, blocks)`: the cost of chunk c holding those blocks (a range;
    default: how many); the first chunk pays for the embeddings, the last for the head and loss."""
    if by_hand is not None:
        sizes = by_hand
    else:
        cost = cost or (lambda _c, blocks: len(blocks))
        # best[c][n]: the least possible maximum cost of chunks 0..c holding the first n blocks
        inf = float("inf")
        best = [[inf] * (n_layer + 1) for _ in range(chunks)]
        cut = [[0] * (n_layer + 1) for _ in range(chunks)]
        for n in range(1, n_layer + 1):
            best[0][n] = cost(0, range(0, n))
        for c in range(1, chunks):
            for n in range(c + 1, n_layer + 1):
                for k in range(1, n - c + 1):  # chunk c holds the last k of n blocks
                    v = max(best[c - 1][n - k], cost(c, range(n - k, n)))
                    if v < best[c][n]:
                        best[c][n], cut[c][n] = v, k
        sizes, n = [], n_layer
        for c in range(chunks - 1, 0, -1):
            sizes.append(cut[c][n])
            n -= cut[c][n]
        sizes = [n] + sizes[::-1]
    out, start = [], 0
    for k in sizes:
        out.append(range(start, start + k))
        start += k
    return out


@functools.lru_cache(maxsize=64)
def _upto(model, seq_len: int) -> tuple:
    """upto[i]: training FLOPs a token of blocks 0 .. i-1 (integers in floats: exact sums, any order)."""
    upto = [0.0]
    for i in range(model.n_layer):
        upto.append(upto[-1] + model.block_flops(i, seq_len))
    return tuple(upto)


def flop_cost(model, seq_len: int, chunks: int):
    """cost(c, blocks) for split(): training FLOPs a token of those blocks (the model's own counts,
    ModelConfig.block_flops: a mixture's experts at their top-k share), plus the final norm's and
    the head's on the last chunk. The first chunk's embedding counts too, for its FLOPs: none (a
    lookup, and its gradient's add). gpt2 on 2 stages: the head weighs 4.5 blocks, so the first
    stage takes 8 of 12."""
    upto, head = _upto(model, seq_len), model.head_flops()
    return lambda c, blocks: upto[blocks.stop] - upto[blocks.start] + (head if c == chunks - 1 else 0)


@functools.lru_cache(maxsize=1024)
def cost_split(model, seq_len: int, chunks: int) -> tuple:
    """split() by flop_cost: the layout's default cut (cached: the planner asks for thousands)."""
    return tuple(split(model.n_layer, chunks, flop_cost(model, seq_len, chunks)))


def check_split(n_layer: int, chunks: int, by_hand: list[int] | None) -> None:
    if n_layer < chunks:
        raise UserError(f"{n_layer} blocks cannot fill pp*v = {chunks} pipeline chunks (a block each at least): "
                        f"use fewer stages or virtual stages, or more layers")
    if by_hand is not None:
        if len(by_hand) != chunks or sum(by_hand) != n_layer or min(by_hand) < 1:
            raise UserError(f"--pp-split {','.join(map(str, by_hand))}: give {chunks} counts of at least 1 block "
                            f"(one per stage and virtual stage) that add up to n_layer = {n_layer}")


# -- the schedules: each rank's compute actions -------------------------------------------------

def compute_order(name: str, pp: int, v: int, m: int) -> list[list[Action]]:
    """Each pipeline rank's F / B / W actions on its chunks, in order."""
    return [{"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb": _zb_h1}[name](pp, v, m, r)
            for r in range(pp)]


def _gpipe(pp, v, m, r):
    return [Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)]


def _one_f_one_b(pp, v, m, r):
    warm = min(pp - r - 1, m)
    out = [Action("F", r, i) for i in range(warm)]
    for i in range(m - warm):
        out += [Action("F", r, warm + i), Action("B", r, i)]
    return out + [Action("B", r, i) for i in range(m - warm, m)]


def _zb_h1(pp, v, m, r):
    """1F1B's order of F and B, each B followed by the W of the micro-batch r backwards before
    (the first stage: at once), the W left over at the end. The later a stage, the sooner its
    B follows its F and passes the gradient on; its W fill the cool-down. (Deferring the first
    stages' W instead gains nothing: `simulate` gives 1f1b's step, the paper's (p-1)(F+B-W)
    bubble comes with this order.)"""
    delay, out, done_w = r, [], 0
    for a in _one_f_one_b(pp, v, m, r):
        out.append(a)
        if a.op == "B" and a.micro - delay >= 0:
            out.append(Action("W", r, a.micro - delay))
            done_w += 1
    return out + [Action("W", r, i) for i in range(done_w, m)]


def _interleaved(pp, v, m, r):
    """Megatron's interleaved 1F1B. Forward k of the rank (k = 0 .. m*v-1) is micro-batch
    (k // (pp*v)) * pp + k % pp of its chunk (k // pp) % v; backwards run the same walk with the
    chunks in reverse. Warm-up: (pp - r - 1) * 2 + (v - 1) * pp forwards."""
    total = m * v

    def walk(k, backward):
        group, j = divmod(k, pp * v)
        local = (j // pp) % v
        chunk = (v - 1 - local) if backward else local
        return chunk * pp + r, group * pp + j % pp

    warm = min((pp - r - 1) * 2 + (v - 1) * pp, total)
    out = [Action("F", *walk(k, False)) for k in range(warm)]
    for i in range(total - warm):
        out += [Action("F", *walk(warm + i, False)), Action("B", *walk(i, True))]
    return out + [Action("B", *walk(k, True)) for k in range(total - warm, total)]


# -- the transfers -----------------------------------------------------------------------------

def with_p2p(order: list[list[Action]], pp: int, v: int) -> list[list[Action]]:
    """Each rank's actions with its sends and receives: RECV_F (a chunk's input, from the rank of
    the chunk before) right before its F, SEND_F right after; RECV_B (a chunk's output gradient,
    from the rank of the chunk after) right before its B, SEND_B (its input's gradient) right
    after."""
    last = pp * v - 1
    out = []
    for actions in order:
        mine = []
        for a in actions:
            if a.op == "F":
                mine += ([Action("RECV_F", a.stage, a.micro)] if a.stage > 0 else []) + [a]
                mine += [Action("SEND_F", a.stage, a.micro)] if a.stage < last else []
            elif a.op == "B":
                mine += ([Action("RECV_B", a.stage, a.micro)] if a.stage < last else []) + [a]
                mine += [Action("SEND_B", a.stage, a.micro)] if a.stage > 0 else []
            else:
                mine.append(a)
        out.append(mine)
    return out


P2P = {"SEND_F": ("act", +1, "send"), "RECV_F": ("act", -1, "recv"), "SEND_B": ("grad", -1, "send"),
       "RECV_B": ("grad", +1, "recv")}  # op -> (what moves, to / from the chunk after or before, direction)


def peer(a: Action, pp: int) -> int:
    """The pipeline rank on the other end of a transfer."""
    return (a.stage + P2P[a.op][1]) % pp


def ends(a: Action, r: int, pp: int) -> tuple[tuple[int, int], tuple, str]:
    """((source rank, destination rank), the tensor moved, 'send' or 'recv') of transfer a on
    rank r. The tensor: ('act', c, i), chunk c's output of micro-batch i, or ('grad', c, i), the
    gradient of chunk c's input."""
    what, step, way = P2P[a.op]
    pair = (r, peer(a, pp)) if way == "send" else (peer(a, pp), r)
    source_chunk = a.stage if way == "send" else a.stage + step
    return pair, (what, source_chunk, a.micro), way


def check(plan: list[list[Action]], pp: int, v: int, m: int, backward: bool = True) -> None:
    """Raises ValueError unless the plan runs: every chunk of a rank does F, then B (and W, if
    split) of each micro-batch once (`backward=False`: F alone); each transfer has its partner, in
    the same order on both ends; and the simulation (sends posted as reached, a receive done once
    its send is posted) finishes."""
    for r, actions in enumerate(plan):
        for c in range(r, pp * v, pp):
            seen = [a for a in actions if a.stage == c and a.op in ("F", "B", "W")]
            split_w = any(a.op == "W" for a in seen)
            for i in range(m):
                ops = [a.op for a in seen if a.micro == i]
                if ops != (["F"] if not backward else ["F", "B", "W"] if split_w else ["F", "B"]):
                    raise ValueError(f"rank {r}, chunk {c}, micro-batch {i}: runs {ops}")
        done = set()
        for a in actions:  # what each action uses is there: its chunk, its input, what it sends
            need = {"SEND_F": "F", "SEND_B": "B"}.get(a.op)
            if a.stage % pp != r or (need and (need, a.stage, a.micro) not in done) \
                    or (a.op == "F" and a.stage > 0 and ("RECV_F", a.stage, a.micro) not in done) \
                    or (a.op == "B" and a.stage < pp * v - 1 and ("RECV_B", a.stage, a.micro) not in done):
                raise ValueError(f"rank {r}: {a!r} comes before what it needs (or is of a chunk it does not hold)")
            done.add((a.op, a.stage, a.micro))
    queues = {}  # (pair, way) -> the tensors, in order
    for r, actions in enumerate(plan):
        for a in actions:
            if a.op in P2P:
                pair, tensor, way = ends(a, r, pp)
                queues.setdefault((pair, way), []).append(tensor)
    for pair in {p for p, _ in queues}:
        if queues.get((pair, "send"), []) != queues.get((pair, "recv"), []):
            raise ValueError(f"transfers from rank {pair[0]} to rank {pair[1]} do not pair up: sent "
                             f"{queues.get((pair, 'send'), [])[:3]}..., received "
                             f"{queues.get((pair, 'recv'), [])[:3]}...")
    simulate(plan, pp, lambda a: 0.0)  # raises if the transfers cannot meet


def simulate(plan, pp: int, cost, hop: float = 0.0, size=lambda _c: 0.0) -> list[dict]:
    """A checked plan run in time, for the planner: each F / B / W takes cost(action) seconds, a
    send none (its direction's stream), a receive ends `hop` seconds after its send was posted
    (or when reached, if later). A micro-batch's activations, size(chunk) bytes, live from the
    start of its forward to the end of its last backward action (W, when split: an upper bound,
    as W keeps only its matmuls' inputs). Per rank: `start` and `end` of its work, `busy` seconds
    working, `peak` bytes alive -- its bubble, as train.py measures it, 1 - busy / end (all start at 0)."""
    steps = _steps(plan if isinstance(plan, tuple) else tuple(map(tuple, plan)), pp)
    at, clock, posted, taken = [0] * pp, [0.0] * pp, {}, {}  # posted: (pair) -> send times, in order
    start, end, busy, peak, alive = [None] * pp, [0.0] * pp, [0.0] * pp, [0.0] * pp, [0.0] * pp
    moved = True
    while moved:  # a round: each rank as far as its receives let it
        moved = False
        for r in range(pp):
            mine, k, now = steps[r], at[r], clock[r]
            while k < len(mine):
                kind, a, pair, frees = mine[k]
                if kind == SEND:
                    posted.setdefault(pair, []).append(now)
                elif kind == RECV:
                    sent, n = posted.get(pair, ()), taken.get(pair, 0)
                    if len(sent) <= n:
                        break  # its send is not reached yet
                    now = max(now, sent[n] + hop)
                    taken[pair] = n + 1
                else:
                    start[r] = now if start[r] is None else start[r]
                    if a.op == "F":
                        alive[r] += size(a.stage)
                        peak[r] = max(peak[r], alive[r])
                    t = cost(a)
                    now += t
                    busy[r] += t
                    end[r] = now
                    if frees:
                        alive[r] -= size(a.stage)
                k += 1
            moved |= k > at[r]
            at[r], clock[r] = k, now
    if any(at[r] < len(steps[r]) for r in range(pp)):
        raise ValueError("the schedule deadlocks: " + "; ".join(
            f"rank {r} waits at {steps[r][at[r]][1]!r}" for r in range(pp) if at[r] < len(steps[r])))
    return [{"start": start[r] or 0.0, "end": end[r], "busy": busy[r], "peak": peak[r]} for r in range(pp)]


SEND, RECV, WORK = 0, 1, 2


@functools.lru_cache(maxsize=512)
def _steps(plan: tuple, pp: int) -> list[list[tuple]]:
    """Per rank, each action as simulate reads it: (SEND or RECV, the action, its (source, destination)
    pair, False) or (WORK, the action, None, whether it is its micro-batch's last backward action on
    its chunk: the activations go) -- worked out once a plan."""
    last = {}  # (rank, chunk, micro) -> index of its last backward action
    for r, actions in enumerate(plan):
        for k, a in enumerate(actions):
            if a.op in ("B", "W"):
                last[r, a.stage, a.micro] = k
    out = []
    for r, actions in enumerate(plan):
        row = []
        for k, a in enumerate(actions):
            if a.op in P2P:
                pair, _, way = ends(a, r, pp)
                row.append((SEND if way == "send" else RECV, a, pair, False))
            else:
                row.append((WORK, a, None, last.get((r, a.stage, a.micro)) == k))
        out.append(row)
    return out


def forward_only(pp: int, v: int, m: int) -> list[list[Action]]:
    """Every rank's actions of a pass of forwards only (validation, sampling): micro-batch by
    micro-batch, each through the rank's chunks in order, with their transfers; checked."""
    plan = with_p2p([[Action("F", c, i) for i in range(m) for c in range(r, pp * v, pp)] for r in range(pp)], pp, v)
    check(plan, pp, v, m, backward=False)
    return plan


@functools.lru_cache(maxsize=512)
def build(name: str, pp: int, v: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """Every pipeline rank's actions, transfers included, checked (once: the planner asks for the
    same schedule for many layouts)."""
    plan = with_p2p(compute_order(name, pp, v, m), pp, v)
    check(plan, pp, v, m)
    return tuple(map(tuple, plan))
