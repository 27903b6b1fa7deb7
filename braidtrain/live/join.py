"""A process that joins a running live-recovering job in place of a lost rank (--join, trainer.py).

It connects to the job's store (-pi tcp -ps), checks that its flags are the job's, asks to join
(live/join/RANK) and waits: rank 0 schedules it for a step boundary, where the members admit it
(live/joined/RANK), rebuild their group over the grown world and send it the state -- which
LiveTrainer.arrive takes and checks by sha256. What it builds meanwhile is build.py's run, minus
what the job already did (rendezvous check-in, run directory, resume).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import tomllib
from datetime import timedelta

import torch
import torch.distributed as dist

from braidtrain.errors import UserError
from braidtrain.collective.mesh import build_mesh

OWN = {"process_rank", "join", "out", "resume", "start_over", "progress", "server", "fs_path", "init_method",
       "timeout", "heartbeat_timeout", "max_steps", "device"}  # a joiner's settings that may differ from the job's


def build_joiner(cfg):
    """The parts of a run for a process that joins a running job in place of lost rank -pr (build.py's
    order, minus what the job already did): the store, then -- once the members admit it at a step
    boundary (LiveTrainer.grow) -- the process group and mesh over the new members, the model and
    engine laid out as the job's (ZeRO-0: its buckets padded for the job's first dp, the same flat
    buffers; ZeRO 1-3: over the members now, as they re-lay theirs), the guard. The state comes
    afterwards, from the members (LiveTrainer.arrive)."""
    from braidtrain import build as b
    from braidtrain.collective.comm import Comm
    from braidtrain.collective.group import Group
    from braidtrain.io.data import Loader, TokenData, data_tokenizer, resolve_files
    from braidtrain.collective.fault import Guard
    from braidtrain.layout import from_config
    from braidtrain.model import registry
    from braidtrain.optim import AdamW
    from braidtrain.parallel import placement
    from braidtrain.parallel.engine import Engine
    from braidtrain.collective.runtime import find_runtime

    rt = find_runtime(cfg.init_method, num_processes=cfg.num_processes, process_rank=cfg.process_rank,
                      gpus_per_node=cfg.gpus_per_node, server=cfg.server, device=cfg.device, timeout_s=cfg.timeout)
    train_files = resolve_files(cfg.train_data, "train")
    val_files = resolve_files(cfg.val_data or cfg.train_data, "val")
    tok_name, vocab = data_tokenizer(train_files, cfg.tokenizer)
    mcfg = registry.model_config(cfg.model, vocab, **b.model_fields(cfg))
    lay = from_config(cfg, rt.world_size, mcfg, rt.device.type)  # the job's first layout: its slots
    if mcfg.moe_experts and mcfg.moe_balance == "bias":
        raise UserError("--join does not receive the experts' balancing biases (--moe-balance bias) from its peer yet: "
                        "restart the job from its checkpoint instead")
    store, prefix = rt._connect()
    launch = dist.PrefixStore(prefix, store)
    rt.store, rt.launch_store = dist.PrefixStore("app", dist.PrefixStore("0", launch)), launch
    rt._store_addr = (store.host, store.port, f"{prefix}/0/app")
    store.set_timeout(timedelta(seconds=cfg.timeout))
    me = rt.rank
    job, mine = (tomllib.loads(t) for t in (rt.store.get("live/config").decode(), cfg.to_toml()))  # (waits for it)
    differ = [k for k in sorted(set(job) | set(mine)) if k not in OWN and job.get(k) != mine.get(k)]
    if differ:
        what = ", ".join(f"{k} {mine.get(k)} (the job's: {job.get(k)})" for k in differ)
        raise UserError(f"--join with flags other than the job's: {what}; give it the job's flags")
    rt.store.set(f"live/join/{me}", str(os.getpid()))
    print(f"braidtrain: rank {me}: asked to join the job at {cfg.server}; waiting for a step boundary", file=sys.stderr,
          flush=True)
    deadline = time.monotonic() + cfg.timeout
    try:
        while not rt.store.check([f"live/joined/{me}"]):
            if time.monotonic() > deadline:
                rt.store.delete_key(f"live/join/{me}")
                raise UserError(f"rank {me}: the job at {cfg.server} did not admit this process within "
                                f"{cfg.timeout:g} s (is rank {me} still one of its members?)")
            time.sleep(0.1)
        adm = json.loads(rt.store.get(f"live/joined/{me}"))
    except dist.DistError:
        raise UserError(f"rank {me}: the job's store at {cfg.server} went away before it admitted this process "
                        f"(the run ended, or its rank 0 was lost)") from None
    if "refused" in adm:
        raise UserError(f"rank {me}: the job refused it: {adm['refused']}")
    ids, n = adm["members"], len(adm["members"])
    if cfg.exact:
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.set_num_threads(1)
    dist.init_process_group(rt.backend, store=dist.PrefixStore(f"live/{adm['epoch']}/pg", rt.store), rank=ids.index(me),
                            world_size=n, timeout=timedelta(seconds=cfg.timeout))
    rt.world_size, rt._owns_group = n, True
    comm = Comm(rt.device)
    mesh = build_mesh(me, n, comm, new_group=rt.new_group, members=ids)
    parts = b.make_parts(mcfg, mesh, lay, cfg.sp)
    for part in parts:
        placement.init_weights(part, cfg.seed)  # (overwritten by the peer's state)
        part.to(rt.device)
    bf16 = b.computes_in_bf16(cfg, rt.device)
    dtype = torch.bfloat16 if bf16 else torch.float32
    if cfg.zero:  # laid out over the members now (parallel/mirror.py re-lays every bucket anyway)
        engine = Engine(parts, mesh, comm, zero=cfg.zero, exact=cfg.exact, bucket_mb=cfg.bucket_mb, device=rt.device,
                        dtype=dtype)
    else:
        job = Group("replica", tuple(range(lay.dp)), me, None, comm, "replica")  # the buckets' padding: the job's
        laid = dataclasses.replace(mesh, groups={**mesh.groups, "replica": job, "expert": job})
        engine = Engine(parts, laid, comm, zero=0, exact=cfg.exact, bucket_mb=cfg.bucket_mb, device=rt.device,
                        dtype=dtype)
        engine.world = mesh.groups["world"]
        for bk in engine.buckets:
            bk.group = mesh.groups[bk.group.axis]
    opt = AdamW(engine, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    out = b.Path(adm["out"])
    guard = Guard(rt, comm, out / "flight", adm["session"], cfg.heartbeat_timeout, cfg.preempt_budget)
    guard.start()
    train_data, val_data = TokenData(train_files, vocab), TokenData(val_files, vocab)
    loader = Loader(train_data, cfg.seq_len, lay.batch.seqs_per_step, cfg.seed)
    val_loader = Loader(val_data, cfg.seq_len, lay.batch.seqs_per_step, cfg.seed)
    cfg.max_steps = adm["max_steps"]
    run = b.Run(cfg, rt, lay, mesh, comm, mcfg, parts, engine, opt, tok_name, train_data, loader, val_loader, out,
                adm["run_id"], None, torch.zeros(mcfg.n_layer, max(1, mcfg.moe_experts), device=rt.device), guard, None,
                bf16, start_step=adm["step"])
    run.admission = adm
    return run


