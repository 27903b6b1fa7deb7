"""layout.py, the one validator of degrees and features (train and plan both call it): every
combination it refuses, each a one-line UserError naming the fix; and what it builds when the
combination can run. (The command line turns a UserError into exit 2 and that line: test_cli.)"""

import pytest

from braidtrain import layout
from braidtrain.errors import UserError
from braidtrain.layout import make_layout
from braidtrain.model import attention
from braidtrain.model.gpt2 import GPTConfig
from braidtrain.model.registry import model_config

MODEL = model_config("tiny", 256, n_layer=2, n_embd=64, n_head=2, block_size=64)
MOE = model_config("tiny", 256, n_layer=2, n_embd=64, n_head=2, block_size=64, moe_experts=6)
BATCH = dict(seq_len=64, batch_size=2)

REFUSED = [  # (id, world, keyword arguments, words the message must hold)
    ("degree-below-1", 1, dict(tp=0), ["--tp 0", ">= 1"]),
    ("cp-seq-not-divisible", 2, dict(cp=2, seq_len=62), ["-t 62", "2*cp = 4 chunks", "-t 60 or -t 64"]),
    ("cp-sp-lcm", 8, dict(cp=2, tp=4, sp=True, seq_len=60, model=GPTConfig(2, 4, 64, 64, 256)),
     ["-t 60", "over tp = 4 (sp)", "-t 56 or -t 64", "multiple of 8"]),
    ("cp-longer-than-sequence", 64, dict(cp=64), ["-t 64", "128 chunks", "use -t 128"]),
    ("cp-exact-not-pow2", 3, dict(cp=3, exact=True, seq_len=60), ["--exact", "power-of-two cp", "cp=3"]),
    ("cp-compile", 2, dict(cp=2, compile=True), ["--compile", "context parallelism", "--cp 1"]),
    ("cp-world", 3, dict(cp=2), ["pp*cp*tp = 1*2*1 = 2 does not divide the world size 3"]),
    ("ep-without-experts", 2, dict(ep=2), ["--ep 2", "mixture of experts", "--moe-experts", "--ep 1"]),
    ("ep-not-dividing-experts", 4, dict(ep=4, model=MOE), ["--ep 4", "--moe-experts 6", "{1,2,3,6}"]),
    ("ep-not-dividing-dp-cp", 2, dict(ep=3, model=MOE, seq_len=60), ["--ep 3", "dp*cp = 2*1 = 2", "{1,2}"]),
    ("moe-compile-ep", 2, dict(compile=True, model=MOE, ep=2), ["--compile", "mixture of experts", "ep 1", "--exact"]),
    ("moe-compile-exact", 1, dict(compile=True, exact=True, model=MOE), ["--compile", "mixture of experts", "--ep 1"]),
    ("moe-exact-ep-micro", 2, dict(cp=2, ep=2, exact=True, model=MOE, total_batch=2 * 64 * 3),
     ["--exact", "ep=2", "power-of-two number of micro-steps", "3"]),
    ("sp-without-tp", 1, dict(sp=True), ["--sp", "--tp 2 or more"]),
    ("compile-with-tp", 2, dict(tp=2, compile=True), ["--compile", "tp", "drop --compile"]),
    ("cuda-graph-zero-2", 1, dict(zero=2, cuda_graph=True, device="cuda"), ["--cuda-graph", "ZeRO", "-z 0 or 1"]),
    ("cuda-graph-with-tp", 2, dict(tp=2, cuda_graph=True, device="cuda"), ["--cuda-graph", "tp=1"]),
    ("cuda-graph-on-cpu", 1, dict(cuda_graph=True), ["--cuda-graph", "needs a GPU", "cpu"]),
    ("seq-over-context", 1, dict(seq_len=100), ["-t 100", "context (64)", "-t 64 or less"]),
    ("tp-not-dividing-heads", 3, dict(tp=3), ["tp=3 does not divide n_head=2", "{1,2}"]),
    ("sp-seq-not-divisible", 2, dict(tp=2, sp=True, seq_len=63), ["sequence length 63", "tp=2", "multiple of 2"]),
    ("world-not-divisible", 3, dict(tp=2), ["pp*cp*tp = 1*1*2 = 2 does not divide the world size 3"]),
    ("d-not-multiple", 2, dict(total_batch=300), ["-d 300", "b*t*dp = 2*64*2 = 256", "-d 256 or -d 512"]),
    ("exact-dp-not-pow2", 3, dict(exact=True), ["--exact", "power-of-two data-parallel size", "dp=3"]),
    ("exact-micro-not-pow2", 2, dict(exact=True, total_batch=3 * 256), ["micro-steps", "= 3", "-d 512 or -d 1024"]),
    ("exact-gpu-head-size", 1, dict(exact=True, device="cuda", model=GPTConfig(2, 2, 96, 64, 256)),
     ["head sizes", "96 / 2 = 48", "--n-head"]),
    # pipelines (MODEL has 2 blocks; DEEP 4)
    ("pp-more-stages-than-blocks", 4, dict(pp=4, schedule="gpipe"), ["2 blocks", "pp*v = 4"]),
    ("pp-interleaved-chunks-over-blocks", 2, dict(pp=2, schedule="interleaved", total_batch=4 * 128),
     ["2 blocks", "pp*v = 4"]),
    ("pp-split-sum", 2, dict(pp=2, split=[1, 2]), ["--pp-split 1,2", "add up to n_layer = 2"]),
    ("pp-split-count", 2, dict(pp=2, split=[2]), ["--pp-split 2", "give 2 counts"]),
    ("pp-1f1b-too-few-micro-steps", 2, dict(pp=2), ["1f1b needs at least pp = 2 micro-steps", "= 1", "-d 256"]),
    ("pp-zb-too-few-micro-steps", 2, dict(pp=2, schedule="zb"), ["zb needs at least pp = 2"]),
    ("pp-interleaved-not-a-multiple", 2, dict(pp=2, schedule="interleaved", model="deep", total_batch=3 * 128),
     ["multiple of pp = 2 micro-steps", "= 3", "-d 256 or -d 512"]),
    ("pp-virtual-without-interleaved", 2, dict(pp=2, virtual=2, total_batch=256), ["--pp-virtual 2", "interleaved"]),
    ("pp-unknown-schedule", 2, dict(pp=2, schedule="zigzag"), ["'zigzag'", "gpipe, 1f1b, interleaved, zb"]),
    ("pp-zero3", 2, dict(pp=2, zero=3, total_batch=256), ["ZeRO-3", "pipeline", "-z 1 or -z 2"]),
    ("pp-cuda-graph", 2, dict(pp=2, cuda_graph=True, device="cuda", total_batch=256), ["--cuda-graph", "pipeline"]),
    ("pp-zb-recompute", 2, dict(pp=2, schedule="zb", recompute=True, total_batch=256), ["zb", "--recompute", "1f1b"]),
    ("pp-zb-compile", 2, dict(pp=2, schedule="zb", compile=True, total_batch=256), ["zb", "--compile"]),
    ("pp-world", 3, dict(pp=2), ["pp*cp*tp = 2*1*1 = 2 does not divide the world size 3"]),
    ("offload-params", 1, dict(offload="params"), ["--offload params", "not built", "--offload optimizer"]),
    ("offload-cuda-graph", 1, dict(offload="optimizer", cuda_graph=True, device="cuda"), ["--cuda-graph", "host"]),
    ("offload-unknown", 1, dict(offload="gpu"), ["unknown --offload 'gpu'", "optimizer"]),
]
DEEP = model_config("tiny", 256, n_layer=4, n_embd=64, n_head=2, block_size=64)


@pytest.mark.parametrize("world, kwargs, words", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_with_one_line_that_names_the_fix(world, kwargs, words):
    kwargs = {**BATCH, "model": MODEL, **kwargs}
    model = DEEP if kwargs["model"] == "deep" else kwargs["model"]
    del kwargs["model"]
    with pytest.raises(UserError) as e:
        make_layout(world, model, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_exact_on_a_gpu_without_triton_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(attention, "available", lambda _device: False)
    with pytest.raises(UserError, match="needs triton.*pip install triton"):
        make_layout(1, MODEL, exact=True, device="cuda", **BATCH)


def test_what_can_run_is_built():
    lay = make_layout(8, MODEL, tp=2, sp=True, zero=3, exact=True, total_batch=2048, **BATCH)
    assert (lay.pp, lay.dp, lay.cp, lay.tp, lay.world, lay.schedule) == (1, 4, 1, 2, 8, "sequential")
    assert lay.batch == layout.BatchPlan(total_tokens=2048, seqs_per_step=32, micro_steps=4, seqs_per_rank=8)
    assert lay.describe() == "dp 4 x tp 2 (sp), ZeRO-3, exact"
    assert not lay.data_parallel_only and make_layout(2, MODEL, **BATCH).data_parallel_only
    # exact mode at tp > 1 is allowed: it holds at a fixed tp (the resume note in build.py says so)
    assert make_layout(4, MODEL, tp=2, exact=True, **BATCH).exact


def test_a_pipeline_layout_is_built_and_described():
    lay = make_layout(4, DEEP, pp=2, zero=1, schedule="interleaved", total_batch=8 * 128, **BATCH)
    assert (lay.pp, lay.dp, lay.virtual, [len(r) for r in lay.split]) == (2, 2, 2, [1, 1, 1, 1])
    assert lay.describe() == "pp 2 (interleaved x2 chunks a rank, blocks 0-0 | 1-1 | 2-2 | 3-3) x dp 2, ZeRO-1"
    assert make_layout(2, DEEP, pp=2, split=[3, 1], total_batch=2 * 128, **BATCH).split == (range(0, 3), range(3, 4))
    assert make_layout(1, DEEP, pp=1, schedule="zb", **BATCH).schedule == "sequential"  # (no pipeline, no schedule)


def test_the_planner_asks_the_same_question(capsys):
    """plan --tp 3 on 8 GPUs is refused by the same check, in the planner's terms (--gpus)."""
    from braidtrain.plan.command import check_mesh
    from braidtrain.plan.space import Setup, valid

    s = Setup(model_config("tiny", 256, n_head=12, n_embd=96), gpus=8, mem_gb=80, t=64, d=64 * 8)
    with pytest.raises(UserError, match=r"^pp\*cp\*tp = 1\*1\*3 = 3 does not divide --gpus 8"):
        check_mesh(s, 3, False)
    assert not valid(s, 2, True, gpus=3) and valid(s, 2, True)
