"""Python's garbage collector during training: never on its own inside a step (where, on one rank,
it would make the peers wait in a collective), by hand at the steps collect_garbage chooses --
counted from the first step of this run, also after a resume -- and back as it was when training
ends, by a clean finish or by an error."""
import json

from helpers import SMALL, launch

SCRIPT = """
import gc, json, sys
from braidtrain import cli, train
from braidtrain.options import Parser, train_config, train_parser

train.GC_EVERY = 3
fail_at = int(sys.argv[1])
state = {"step": None, "by_hand": False}
automatic, by_hand = [], []

def callback(phase, info):
    if phase == "start" and state["step"] is not None:
        (by_hand if state["by_hand"] else automatic).append(state["step"])

real_collect, real_step = gc.collect, train.Trainer.step

def collect(*args):
    state["by_hand"] = True
    try:
        return real_collect(*args)
    finally:
        state["by_hand"] = False

def step(self, s):
    state["step"] = s
    try:
        if s == fail_at:
            raise RuntimeError("a step that fails")
        return real_step(self, s)
    finally:
        state["step"] = None

gc.collect, train.Trainer.step = collect, step
gc.callbacks.append(callback)
cfg = train_config(train_parser(Parser().add_subparsers(parser_class=Parser)).parse_args(sys.argv[2:]))
try:
    cli.train(cfg)
    error = None
except RuntimeError as e:
    error = str(e)
print(json.dumps({"automatic": automatic, "by_hand": sorted(set(by_hand)), "enabled": gc.isenabled(),
                  "frozen": gc.get_freeze_count(), "error": error}))
"""


def run(out, *extra, fail_at=-1):
    """SCRIPT as `python SCRIPT FAIL_AT ARGS`, forked by the tests' process server (helpers.launch:
    torch and braidtrain imported once; the server's collector is as a fresh interpreter's)."""
    script = out.parent / "gc_probe.py"
    script.write_text(SCRIPT)
    p = launch(script, fail_at, *SMALL, "-d", 256, "--out", out, *extra)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_collector_runs_only_by_hand_during_steps(tmp_path, shakespeare):
    got = run(tmp_path / "run", "-i", shakespeare, "-x", 8)
    assert got["automatic"] == []  # no collection of its own inside any step
    assert got["by_hand"] == [0, 3, 6]  # the first step (then freeze), then every GC_EVERY steps
    assert got["enabled"] and got["frozen"] == 0 and got["error"] is None  # as it was before training
    # resumed from the final checkpoint (step 8): the same rule, counted from there
    got = run(tmp_path / "run", "-i", shakespeare, "-x", 12, "--resume", "auto")
    assert got["automatic"] == [] and got["by_hand"] == [8, 11] and got["enabled"] and got["frozen"] == 0


def test_collector_is_back_after_a_failed_step(tmp_path, shakespeare):
    got = run(tmp_path / "run", "-i", shakespeare, "-x", 8, fail_at=2)
    assert got["error"] == "a step that fails" and got["by_hand"] == [0]
    assert got["enabled"] and got["frozen"] == 0
