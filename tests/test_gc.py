"""Python's garbage collector during training: never on its own inside a step (where, on one rank,
it would make the peers wait in a collective), by hand at the steps collect_garbage chooses, and
back as it was when training ends."""
import json
import subprocess
import sys

from helpers import ROOT, SMALL, env

SCRIPT = """
import gc, json, sys
from braidtrain import train
from braidtrain.cli import Parser, _train_parser, train_config

train.GC_EVERY = 3
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
        return real_step(self, s)
    finally:
        state["step"] = None

gc.collect, train.Trainer.step = collect, step
gc.callbacks.append(callback)
cfg = train_config(_train_parser(Parser().add_subparsers(parser_class=Parser)).parse_args(sys.argv[1:]))
train.train(cfg)
print(json.dumps({"automatic": automatic, "by_hand": sorted(set(by_hand)), "enabled": gc.isenabled(),
                  "frozen": gc.get_freeze_count()}))
"""


def test_collector_runs_only_by_hand_during_steps(tmp_path, shakespeare):
    args = [*SMALL, "-i", shakespeare, "-d", 256, "-x", 8, "--out", tmp_path / "run"]
    p = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, args)], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["automatic"] == []  # no collection of its own inside any step
    assert got["by_hand"] == [0, 3, 6]  # the first step (then freeze), then every GC_EVERY steps
    assert got["enabled"] and got["frozen"] == 0  # as it was before training
