"""TensorBoard and W&B (braidtrain/io/trackers.py): each read back from its own files -- TensorBoard's
event files by TensorBoard's own reader, W&B's offline run from its .wandb file -- holds every
step's every metrics.jsonl field, once, across a kill and `--resume auto` (TensorBoard's as float32)."""
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from braidtrain import cli
from braidtrain.io import trackers
from helpers import ROOT, SMALL, braidtrain, env, launch, metrics

tensorboard = pytest.importorskip("tensorboard")  # `make test` installs both
wandb = pytest.importorskip("wandb")

EVAL = ROOT / "tests" / "fixtures" / "tiny_eval.bin"  # (bytes tokenizer, as the shakespeare fixture)


def read_tensorboard(logdir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value}, as TensorBoard shows them: the EventAccumulator of its Python data
    provider reads the folder's event files in order and drops what a restart's purge marker says
    to (size_guidance 0: every step, no sampling)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import TENSORS, EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(logdir), size_guidance={TENSORS: 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        events = acc.Tensors(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), (tag, steps)  # no step twice
        out[tag] = {e.step: tensor_util.make_ndarray(e.tensor_proto).item() for e in events}
    return out


def wandb_records(path: Path):
    """The protobuf records of a .wandb file: W&B's log format (a 7-byte header ':W&B', 0xBEE1,
    version; then 32 KiB blocks of chunks, each a 7-byte header -- crc32, length, type: full, first,
    middle, last -- and its bytes; a block's tail shorter than a header is padding)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, block, pos, chunks = path.read_bytes(), 32768, 7, b""
    assert raw[:4] == b":W&B", raw[:7]
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos: pos + 7])
        if kind == 0:  # zero padding to the block's end
            pos += block - pos % block
            continue
        chunks += raw[pos + 7: pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # full, last
            rec = pb.Record()
            rec.ParseFromString(chunks)
            chunks = b""
            yield rec


def read_wandb(folder: Path) -> tuple[str, dict[int, dict]]:
    """(the run id, {step: its history row}) of one offline run folder; no step twice."""
    (path,) = folder.glob("run-*.wandb")
    run_id, rows = None, {}
    for rec in wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run_id = rec.run.run_id
        elif kind == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            assert row["_step"] not in rows, row["_step"]
            rows[row["_step"]] = row
    return run_id, rows


def expected(rec: dict) -> dict:
    """A metrics.jsonl record's scalars, as the trackers name them (trackers.scalars' rule, spelled out)."""
    out = {}
    for k, v in rec.items():
        if isinstance(v, list):
            out.update({f"{k}/{i}": x for i, x in enumerate(v)})
        elif isinstance(v, (int, float)) and k != "step":
            out[k] = float(v)
    return out


def test_scalars():
    rec = {"step": 3, "loss": 2.5, "mfu": None, "skipped": True, "skip_reason": "loss is nan", "bubble": [0.25, 0.5],
           "val_loss": float("nan"), "eval_correct": 7}
    assert trackers.scalars(rec) == {"loss": 2.5, "skipped": 1.0, "bubble/0": 0.25, "bubble/1": 0.5, "eval_correct": 7.0}


def test_both_follow_metrics_across_a_kill_and_resume(tmp_path, shakespeare):
    """Two ranks (only rank 0 writes) killed at step 4, the last checkpoint at step 2; `--resume auto`
    on one rank to step 6. TensorBoard (through its reader, purges applied) and the W&B run (one
    offline folder, the id the first attempt chose) each hold steps 1-6 once, every field of every
    step -- validation and multiple-choice evaluation included -- equal to metrics.jsonl's."""
    run = tmp_path / "run"
    wb = dict(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=str(tmp_path / "wandb-dir"),
              WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"), WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
              WANDB_DATA_DIR=str(tmp_path / "wandb-data"))
    args = ["train", *SMALL, "-i", shakespeare, "-x", 6, "--ckpt-every", 2, "--val-every", 2, "--eval-data", EVAL,
            "--eval-every", 3, "--out", run, "--tensorboard", "--wandb", "braidtrain-test"]
    killed = braidtrain(*args, nproc=2, check=False, environ=dict(env(), BRAIDTRAIN_FAULT="kill:step=4", **wb))
    assert killed.returncode != 0 and "fault injected" in killed.stderr, killed.stderr[-2000:]
    assert len(list((run / "tb").glob("events.out.tfevents.*"))) == 1  # rank 0's alone
    run_id = (run / "wandb" / "braidtrain-run-id").read_text().strip()
    braidtrain(*args, "--resume", "auto", environ=dict(env(), **wb))

    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert {"val_loss", "eval_acc"} <= set(rows[5]) and "eval_acc" in rows[2]
    want = {r["step"]: expected(r) for r in rows}

    tb = read_tensorboard(run / "tb")
    assert set(tb) == {k for fields in want.values() for k in fields}
    for tag, by_step in tb.items():  # (TensorBoard's scalars are float32)
        assert by_step == {s: float(np.float32(f[tag])) for s, f in want.items() if tag in f}, tag

    (folder,) = (run / "wandb").glob("offline-run-*")  # the killed attempt's is superseded
    got_id, history = read_wandb(folder)
    assert got_id == run_id and folder.name.endswith(run_id)
    assert sorted(history) == [1, 2, 3, 4, 5, 6]
    for step, fields in want.items():
        row = {k: v for k, v in history[step].items() if not k.startswith("_")}
        assert row == fields, step


def test_missing_packages_are_one_line(monkeypatch, capsys):
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name, *a: None if name in ("tensorboard", "wandb") else real(name, *a))
    for flag, package in ((["--tensorboard"], "tensorboard"), (["--wandb", "p"], "wandb")):
        assert cli.main(["train", *flag, "-i", "/nonexistent/data"]) == 2  # (failing before it looks for data)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"pip install {package}`" in err, err


def test_imported_only_when_asked(tmp_path):
    """`import braidtrain` and its commands load none of the optional packages."""
    script = tmp_path / "probe.py"
    script.write_text("import sys\nimport braidtrain.cli, braidtrain.train, braidtrain.io.data, braidtrain.io.corpus, "
                      "braidtrain.io.trackers\nprint(sorted({'tensorboard', 'wandb', 'pyarrow', 'llama_models'} & "
                      "set(sys.modules)))\n")
    p = launch(script)
    assert p.returncode == 0 and p.stdout.strip() == "[]", (p.stdout, p.stderr)


def test_a_wandb_run_that_cannot_start_is_one_line(tmp_path, shakespeare):
    """W&B online with no API key (HOME and W&B's folders empty: nothing is sent anywhere) on two
    ranks: rank 0's W&B fails before the first step, and every rank stops with its one line."""
    home = tmp_path / "home"
    e = {k: v for k, v in env().items() if not k.startswith("WANDB_")}
    e.update(HOME=str(home), WANDB_CONFIG_DIR=str(home / "config"), WANDB_CACHE_DIR=str(home / "cache"),
             WANDB_DATA_DIR=str(home / "data"), WANDB_SILENT="true")
    p = braidtrain("train", *SMALL, "-i", shakespeare, "-x", 2, "--out", tmp_path / "run", "--wandb", "braidtrain-test",
                   nproc=2, check=False, environ=e)
    errors = [line for line in p.stderr.splitlines() if line.startswith("braidtrain: error:")]
    assert p.returncode == 2 and errors and "Traceback" not in p.stderr, p.stderr[-3000:]
    for line in errors:
        assert "--wandb braidtrain-test: W&B could not start the run (" in line and "WANDB_MODE=offline" in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
