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
