"""Stop, resume, and end with the same weights: on the same layout, on another layout (exact
mode), and past a damaged checkpoint."""

import json
import shutil

from helpers import SMALL, braidtrain, metrics, summary

D = 512


def run(data, out, *extra, nproc=1, steps=8, check=True):
    return braidtrain("train", *SMALL, "-i", data, "-d", D, "-x", steps, "--ckpt-every", 4, "--out", out, *extra,
                      nproc=nproc, check=check)


def interrupt(src, dst):
    """A copy of a finished run as it was after step 4: the step-8 checkpoint and summary gone."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "step_00000008")
    (dst / "summary.json").unlink()


def test_resume_matches_uninterrupted_run(tmp_path, shakespeare):
    full = tmp_path / "full"
    run(shakespeare, full)
    ckpts = sorted(p.name for p in (full / "checkpoints").iterdir())
    assert ckpts == ["step_00000004", "step_00000008"]
    resumed = tmp_path / "resumed"
    interrupt(full, resumed)
    p = run(shakespeare, resumed, "--resume", "auto")
    assert "resumed from" in p.stdout + p.stderr
    assert summary(resumed)["weights_sha256"] == summary(full)["weights_sha256"]
    assert [r["step"] for r in metrics(resumed)] == list(range(1, 9))
    assert [r["loss"] for r in metrics(resumed)] == [r["loss"] for r in metrics(full)]


def test_exact_resume_on_another_layout(tmp_path, shakespeare):
    """Saved by 2 ranks with ZeRO-1, resumed by 4 ranks with ZeRO-3 and, in the format before the
    placement table, by 1 rank with ZeRO-0; saved by 1 rank with ZeRO-3 (which runs ZeRO-0's
    mechanics: nothing to shard), resumed by 2 with ZeRO-3: the same bits as 1 rank throughout."""
    ref = tmp_path / "ref"
    run(shakespeare, ref, "--exact", "-z", 3)
    two = tmp_path / "two"
    run(shakespeare, two, "--exact", "-z", 1, nproc=2)
    assert summary(two)["weights_sha256"] == summary(ref)["weights_sha256"]
    resumed3 = tmp_path / "resumed3"
    interrupt(two, resumed3)
    p = run(shakespeare, resumed3, "--exact", "-z", 3, "--resume", "auto", nproc=4)
    assert "step_00000004" in p.stdout
    assert summary(resumed3)["weights_sha256"] == summary(ref)["weights_sha256"]
    # a checkpoint in the format before meta.json held the placement table (format 2: the tensors'
    # local shapes instead) still resumes, the table then built from its model config
    old = tmp_path / "format2"
    interrupt(two, old)
    meta_path = old / "checkpoints" / "step_00000004" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["placement"]
    meta.update(format=2, shapes={"wte.weight": [256, 64]})  # (not read: every reader takes the table)
    meta_path.write_text(json.dumps(meta))
    run(shakespeare, old, "--exact", "--resume", "auto")
    assert summary(old)["weights_sha256"] == summary(ref)["weights_sha256"]
    from_one = tmp_path / "from_one"
    interrupt(ref, from_one)
    run(shakespeare, from_one, "--exact", "-z", 3, "--resume", "auto", nproc=2)
    assert summary(from_one)["weights_sha256"] == summary(ref)["weights_sha256"]


def per_expert(ckpt):
    """Checkpoint folder `ckpt` rewritten as braidtrain wrote it when each expert was a module of its
    own (format 3): expert i of a stack ...experts.<kind> a tensor ...experts.<i>.<kind>, in the
    placement table and in the pieces (of a tp 1 run: all in one file here)."""
    import hashlib

    from safetensors.torch import save_file

    from braidtrain.io.checkpoint import Reader

    meta = json.loads((ckpt / "meta.json").read_text())
    read, table, tensors = Reader(ckpt, meta), {}, {}
    for name, e in meta["placement"].items():
        for i in range(e["shape"][0]) if e["expert"] else [None]:
            old = name if i is None else name.replace(".experts.", f".experts.{i}.")
            table[old] = {**e, "shape": e["shape"] if i is None else e["shape"][1:]}
            for kind in ("param", "m", "v"):
                t = read.full(kind, name)
                tensors[f"{kind}/{old}/t0/0"] = (t if i is None else t[i]).reshape(-1).contiguous()
    for f in meta["files"]:
        (ckpt / f).unlink()
    save_file(tensors, str(ckpt / "rank_00000.safetensors"))
    data = (ckpt / "rank_00000.safetensors").read_bytes()
    meta.update(format=3, placement=table, files={"rank_00000.safetensors": hashlib.sha256(data).hexdigest()},
                sizes={"rank_00000.safetensors": len(data)})
    (ckpt / "meta.json").write_text(json.dumps(meta))


def test_a_checkpoint_of_a_tensor_per_expert_resumes_into_stacks(tmp_path, shakespeare):
    """A mixture's checkpoint from before its experts were stacked (per_expert) resumes at ep 2 and
    ends with the bits of the run that never stopped (exact mode; biases of 48 elements: stacks
    whose slices are strided views of the flat buffers)."""
    moe = ["--moe-experts", "4", "--moe-hidden", "48", "--moe-capacity", "1.0", "--exact"]
    full, old = tmp_path / "full", tmp_path / "old"
    run(shakespeare, full, *moe)
    interrupt(full, old)
    per_expert(old / "checkpoints" / "step_00000004")
    p = run(shakespeare, old, *moe, "--ep", 2, "--resume", "auto", nproc=2)
    assert "ep 1 -> 2" in p.stdout, p.stdout
    assert summary(old)["weights_sha256"] == summary(full)["weights_sha256"]
    assert [(r["loss"], r["grad_norm"]) for r in metrics(old)] == [(r["loss"], r["grad_norm"]) for r in metrics(full)]


def test_damaged_checkpoint_is_skipped(tmp_path, shakespeare):
    full = tmp_path / "full"
    run(shakespeare, full, steps=4)
    step4 = full / "checkpoints" / "step_00000004"
    # a later checkpoint whose file was damaged after publishing: one flipped byte
    bad = full / "checkpoints" / "step_00000006"
    shutil.copytree(step4, bad)
    f = bad / "rank_00000.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    p = run(shakespeare, full, "--resume", "auto", steps=4)
    out = p.stdout + p.stderr
    assert "skipping" in out and "checksum" in out and "step_00000006" in out
    assert "resumed from" in out and "step_00000004" in out


def files_of(folder):
    """Every file under `folder` (its lock aside) and its sha256."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_a_run_directory_belongs_to_one_run(tmp_path, shakespeare):
    """A new run into a directory that holds another run stops before training, in one line, and
    leaves it as it was; so does any run while another holds the directory (its lock). With
    --start-over it moves that run aside, whole, and trains; --resume auto then continues it."""
    import fcntl
    import os

    out = tmp_path / "run"
    run(shakespeare, out, steps=8)  # saves step 4 and 8
    before = files_of(out)
    p = run(shakespeare, out, steps=6, check=False)
    err = p.stderr.strip()
    assert p.returncode == 2 and len(err.splitlines()) == 1, p.stderr
    assert "holds another run" in err and "--resume auto" in err and "--start-over" in err, err
    assert files_of(out) == before
    fd = os.open(out / ".lock", os.O_RDWR)  # a run at work there: it holds the lock
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        for extra in (("--resume", "auto"), ("--start-over",)):
            p = run(shakespeare, out, *extra, steps=9, check=False)
            assert p.returncode == 2 and "in use by another run" in p.stderr and len(p.stderr.strip().splitlines()) == 1
            assert files_of(out) == before
    finally:
        os.close(fd)
    p = run(shakespeare, out, "--start-over", steps=6)
    aside = [d for d in tmp_path.iterdir() if d.name.startswith("run.replaced-")]
    assert len(aside) == 1 and files_of(aside[0]) == before, aside
    new_id = json.loads((out / "run.json").read_text())["id"]
    assert new_id != json.loads((aside[0] / "run.json").read_text())["id"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]
    p = run(shakespeare, out, "--resume", "auto", steps=8)
    assert "resumed from" in p.stdout and "step_00000006" in p.stdout
    assert [r["step"] for r in metrics(out)] == list(range(1, 9))
    runs = {json.loads((c / "meta.json").read_text())["run"] for c in (out / "checkpoints").iterdir()}
    assert runs == {new_id}


def test_rotation_deletes_only_its_own_run(tmp_path):
    """Rotation keeps the newest of this run's checkpoints and removes its unfinished saves;
    another run's checkpoints and saves in progress it leaves alone (ids from before ids: ours)."""
    from braidtrain.io.checkpoint import RUN_MARK, rotate

    ckpts = tmp_path / "checkpoints"
    for step, run_id in ((1, "old"), (2, "mine"), (3, "other"), (4, None), (5, "mine"), (6, "mine")):
        (ckpts / f"step_{step:08d}").mkdir(parents=True)
        (ckpts / f"step_{step:08d}" / "meta.json").write_text(json.dumps({} if run_id is None else {"run": run_id}))
    for step, run_id in ((7, "mine"), (8, "other")):
        (ckpts / f"step_{step:08d}.tmp").mkdir()
        (ckpts / f"step_{step:08d}.tmp" / RUN_MARK).write_text(run_id)
    rotate(ckpts, 2, "mine")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001", "step_00000003", "step_00000005",
                                                      "step_00000006", "step_00000008.tmp"]
