"""`braidtrain bench comm` on 2 gloo processes: every operation checked correct, nccl-tests' accounting.
`braidtrain bench train` on 2 gloo processes: braidtrain (ZeRO-3) and torch DDP train the same
model on the same data, so in fp32 their losses agree -- the benchmark compares like with like; and
on one, braidtrain's Llama (and Mixtral) against transformers' LlamaForCausalLM (MixtralForCausalLM;
`--torch hf`) holding its weights."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import braidtrain, forked
from braidtrain import cli
from braidtrain.bench import torchref
from braidtrain.bench import train as bench
from braidtrain.bench.comm import OPS, sizes
from braidtrain.bench.train import BUSY, _median_row, gpu_load, run_job as bench_run_job, slowest
from braidtrain.collective.comm import bus_factor
from braidtrain.model import registry
from braidtrain.parallel.placement import init_weights


def bench_train(*args, monkeypatch, capsys) -> SimpleNamespace:
    """`braidtrain bench train ARGS` in this process, each variant's torchrun job forked
    (helpers.forked, unless the test set run_job already): returncode, stdout, stderr."""
    if bench.run_job is bench_run_job:
        monkeypatch.setattr(bench, "run_job", forked)
    code = cli.main(["bench", "train", *map(str, args)])
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def test_bench_comm_two_ranks(tmp_path):
    out = tmp_path / "comm.json"
    p = braidtrain("bench", "comm", "--min-bytes", "1K", "--max-bytes", "64K", "--iters", "3", "--warmup", "1",
                   "--json", out, nproc=2, timeout=180)
    rows = json.loads(out.read_text())
    assert [(r["op"], r["bytes"]) for r in rows] == [(op, s) for op in OPS for s in sizes(1024, 65536)]
    for r in rows:
        assert r["correct"] and r["ranks"] == 2 and r["time_us"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bus_factor(r["op"], 2))
    assert "busbw GB/s" in p.stdout


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("reduce_scatter", 8) == bus_factor("all_gather", 8) == bus_factor("all_to_all", 8) == pytest.approx(0.875)
    assert bus_factor("send_recv", 8) == 1.0
    assert sizes(1024, 1 << 30)[-1] == 1 << 30 and len(sizes(1024, 1 << 30)) == 11


def test_bench_train_against_torch(tmp_path, shakespeare, monkeypatch, capsys):
    out = tmp_path / "train.json"
    p = bench_train("--model", "tiny", "--n-layer", "2", "--n-embd", "64", "--n-head", "2",
                    "-i", shakespeare, "-b", "2", "-t", "64", "--steps", "4", "--warmup", "1", "--nproc", "2",
                    "--layout", "-z 3", "--torch", "ddp", "--baseline", "ddp", "--json", out, "--repeat", "2",
                    "--keep", tmp_path / "keep", monkeypatch=monkeypatch, capsys=capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["braidtrain -z 3", "torch ddp"]
    ref = rows["torch ddp"]
    assert ref["ratio"] == 1.0 and ref["tokens_per_step"] == 8 * 2 * 64 * 2
    # two rounds: each variant's row is its slower run (the lower median of two), every run listed
    for r in rows.values():
        assert len(r["runs_tokens_per_s"]) == 2 and r["tokens_per_s"] == min(r["runs_tokens_per_s"]), r
    assert ref["runs_ratio"] == [1.0, 1.0] and "every run" in p.stdout and "[round 2/2, 1/2] torch ddp" in p.stderr
    assert all((tmp_path / "keep" / f"round{k}" / "braidtrain0" / "metrics.jsonl").exists() for k in (1, 2))
    for r in rows.values():
        assert "error" not in r and r["tokens_per_s"] > 0 and r["ranks"] == 2
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5), (r, ref)  # 4 steps of the same training
    assert rows["braidtrain -z 3"]["exposed_comm_frac"] >= 0 and ref["exposed_comm_frac"] is None
    assert rows["braidtrain -z 3"]["attention"] == "sdpa" and ref.get("attention") is None  # (the run's choice)
    # the collectives' effective bandwidth: bus bytes (nccl-tests' factors) over their summed time
    assert rows["braidtrain -z 3"]["comm_busbw_GBps"] > 0 and ref["comm_busbw_GBps"] is None
    # the host's share of the step (on a CPU nearly all of it: the work is done as it is issued)
    assert 0.5 < rows["braidtrain -z 3"]["host_frac"] <= 1 and ref["host_frac"] is None and " host " in p.stdout
    assert all(isinstance(r["slowest"], float) for r in rows.values()) and "slowest" in p.stdout  # its maths: below
    assert "SM MHz" in p.stdout and not any("sm_mhz" in r for r in rows.values())  # no GPU, no samples
    assert "x ddp" in p.stdout


@pytest.mark.parametrize("preset, layout", [("llama3-tiny", "-z 0"), ("mixtral-tiny", "-z 0 --moe-aux 0")])
def test_hf_yardstick_trains_as_braidtrain_does(tmp_path, shakespeare, monkeypatch, capsys, preset, layout):
    """--torch hf: transformers' LlamaForCausalLM (MixtralForCausalLM) from braidtrain's initial
    weights, on the same sequences with the same schedule and clipping: in fp32 its final loss is
    braidtrain's (a mixture's without the balance loss, which transformers leaves out: --moe-aux 0)."""
    tol = 1e-5
    pytest.importorskip("transformers", reason="transformers is not installed: `make test` installs it")
    out = tmp_path / "train.json"
    p = bench_train("--model", preset, "--n-layer", "2", "-i", shakespeare, "-b", "2", "-t", "64",
                    "--steps", "3", "--warmup", "1", "--nproc", "1", "--layout", layout, "--torch", "hf",
                    "--json", out, monkeypatch=monkeypatch, capsys=capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert list(rows) == [f"braidtrain {layout}", "torch hf"] and "x hf" in p.stdout  # the baseline: the first of --torch
    ours, theirs = rows[f"braidtrain {layout}"], rows["torch hf"]
    assert theirs["ratio"] == 1.0 and theirs["tokens_per_s"] > 0
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=tol), (ours, theirs)  # well inside --loss-tol


def test_fsdp2_offload_yardstick_trains_as_braidtrain_does(tmp_path, shakespeare, monkeypatch, capsys):
    """--torch fsdp2-offload: transformers' LlamaForCausalLM under FSDP2 with CPUOffloadPolicy, sharded
    over 2 gloo ranks (on the CPU unpinned: torch pins only beside an accelerator), trains what
    braidtrain trains -- its final loss is braidtrain's in fp32 -- and reports its host peak (max RSS)."""
    pytest.importorskip("transformers", reason="transformers is not installed: `make test` installs it")
    out = tmp_path / "train.json"
    p = bench_train("--model", "llama3-tiny", "--n-layer", "2", "-i", shakespeare, "-b", "2", "-t", "64",
                    "--steps", "3", "--warmup", "1", "--nproc", "2", "--layout", "-z 1", "--torch", "fsdp2-offload",
                    "--json", out, monkeypatch=monkeypatch, capsys=capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    ours, theirs = rows["braidtrain -z 1"], rows["torch fsdp2-offload"]
    assert theirs["tokens_per_s"] > 0 and ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5), (ours, theirs)
    assert theirs["host_gb"] > 0.05 and ours["host_gb"] is None and "host GB" in p.stdout  # (python + torch alone)


@pytest.mark.parametrize("preset, shape", [("llama3-tiny", {}), ("llama3-tiny", {"tie_embeddings": True}),
                                           ("llama3-tiny", {"qk_norm": True}), ("tiny", {"n_layer": 2}),
                                           ("mixtral-tiny", {"qk_norm": True, "n_layer": 2})])
def test_hf_yardstick_holds_braidtrain_weights(preset, shape):
    """hf_model: transformers' class of the model (untied and tied Llama, Qwen3, GPT-2, Qwen3-MoE:
    its experts fused in memory, our stacks) computes the logits braidtrain's model does from the
    same seed."""
    pytest.importorskip("transformers", reason="transformers is not installed: `make test` installs it")
    mcfg = registry.model_config(preset, 300, **shape)
    ours = registry.build(mcfg)
    init_weights(ours, 7)
    theirs = torchref.hf_model(mcfg, 7, torch.device("cpu"))
    arch = {"tiny": "GPT2LMHeadModel", "mixtral-tiny": "Qwen3MoeForCausalLM"}.get(
        preset, "Qwen3ForCausalLM" if shape.get("qk_norm") else "LlamaForCausalLM")
    assert type(theirs).__name__ == arch and theirs.config._attn_implementation == "sdpa"
    # past llama3-tiny's 64 unscaled positions
    x = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=x).logits, ours(x), atol=1e-5, rtol=0)


def test_hf_yardstick_without_transformers_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    code = cli.main(["bench", "train", "--model", "llama3-tiny", "-t", "64", "--torch", "ddp,hf-compile"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "install the transformers package" in err and "LlamaForCausalLM" in err


def test_titan_yardstick_trains_as_braidtrain_does(tmp_path, shakespeare, monkeypatch, capsys):
    """--torch titan: torchtitan's own llama3 Transformer, apply_fsdp (one rank) and loss, holding
    braidtrain's initial weights through its own HuggingFace adapter: in fp32 its final loss is
    braidtrain's; titan-fp8 (its float8 converter, torchao's emulation on the CPU) near it.
    (torchtitan is not a dependency: skipped where it is not installed; its MoE runs on CUDA only,
    its router's histc has no CPU kernel for integers.)"""
    pytest.importorskip("torchtitan", reason="torchtitan 0.2.2 is not installed (bench/titan.py: not a dependency)")
    pytest.importorskip("torchao", reason="torchao is not installed (titan-fp8's converter)")
    import torchtitan

    # torchtitan is often installed in a --target folder, which the jobs find through PYTHONPATH
    found = str(Path(torchtitan.__file__).parent.parent)
    monkeypatch.setattr(bench, "run_job", lambda cmd, env: forked(cmd, env, path=found))
    out = tmp_path / "train.json"
    p = bench_train("--model", "llama3-tiny", "--n-layer", "2", "-i", shakespeare, "-b", "2", "-t", "64",
                    "--steps", "3", "--warmup", "1", "--nproc", "1", "--layout", "-z 0", "--torch", "titan,titan-fp8",
                    "--json", out, monkeypatch=monkeypatch, capsys=capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["braidtrain -z 0", "torch titan", "torch titan-fp8"] and "x titan" in p.stdout
    ours, theirs, fp8 = rows["braidtrain -z 0"], rows["torch titan"], rows["torch titan-fp8"]
    assert theirs["ratio"] == 1.0 and theirs["tokens_per_s"] > 0 and fp8["tokens_per_s"] > 0
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5), (ours, theirs)
    assert fp8["loss"] == pytest.approx(theirs["loss"], rel=1e-2) and fp8["loss"] != theirs["loss"]


def test_titan_model_holds_braidtrain_weights():
    """bench/titan.build: torchtitan's llama3 Transformer (its q/k rows permuted back by its own
    adapter; Llama-3.2's tied head as a head of its own) computes braidtrain's logits from the same
    seed; compiled (each block in torch.compile's wrapper, not run here), it holds the same weights."""
    pytest.importorskip("torchtitan", reason="torchtitan 0.2.2 is not installed (bench/titan.py: not a dependency)")
    import torch.distributed as dist

    from braidtrain.bench import titan

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _titan_holds_weights(titan)
    finally:
        dist.destroy_process_group()


def _titan_holds_weights(titan):
    x = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(0))
    for shape in ({}, {"tie_embeddings": True}):
        mcfg = registry.model_config("llama3-tiny", 300, n_layer=2, **shape)
        ours = registry.build(mcfg)
        init_weights(ours, 7)
        theirs = titan.build("titan", mcfg, 96, torch.device("cpu"), 7, 1)
        with torch.no_grad():
            torch.testing.assert_close(theirs.model(x), ours(x), atol=1e-5, rtol=0)
            compiled = titan.build("titan", mcfg, 96, torch.device("cpu"), 7, 1, compile=True)
            assert type(compiled.model.layers["0"]).__name__ != type(theirs.model.layers["0"]).__name__
            full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # (FSDP's, sharded or not)
            for (n, a), b in zip(theirs.model.named_parameters(), compiled.model.parameters()):
                assert torch.equal(full(a), full(b)), n


def test_titan_yardstick_refuses_what_it_cannot_build(monkeypatch, capsys):
    """Without torchtitan, and for a model it has no class of (GPT-2): one line each, exit 2."""
    monkeypatch.setitem(sys.modules, "torchtitan", None)
    code = cli.main(["bench", "train", "--model", "llama3-tiny", "-t", "64", "--torch", "titan"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "torchtitan==0.2.2" in err
    monkeypatch.undo()
    pytest.importorskip("torchtitan", reason="torchtitan 0.2.2 is not installed")
    code = cli.main(["bench", "train", "--model", "gpt2", "-t", "64", "--torch", "titan"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Llama" in err


def test_rows_give_the_median_step_beside_the_mean(tmp_path):
    """A row's "median_tokens_per_s" is a step's tokens over the median timed step (#58's targets are
    stated so); tokens_per_s stays the timed tokens over the timed seconds, which a slow step pulls down."""
    steps = [9.0, 1.0, 2.0, 1.0, 4.0]  # the first untimed
    (tmp_path / "t.json").write_text(json.dumps({"step_s": steps, "tokens_per_step": 100, "loss": [1.0] * 5,
                                                 "mem_gb": None, "flops_per_token": 1, "peak_flops": None}))
    theirs = bench._torch_row(tmp_path / "t.json", 1)
    assert theirs["median_tokens_per_s"] == pytest.approx(100 / 1.5) and theirs["tokens_per_s"] == pytest.approx(50)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(
        {"step_s": s, "tokens_per_s": 100 / s, "mfu": None, "mem_gb": 1.0, "comm_busbw_GBps": None, "comm_s": 0,
         "exposed_comm_s": 0, "host_s": 0, "loss": 1.0}) + "\n" for s in steps))
    ours = bench._braidtrain_row(tmp_path, 1)
    assert ours["median_tokens_per_s"] == pytest.approx(100 / 1.5) and ours["tokens_per_s"] == pytest.approx(50)


@pytest.mark.parametrize("mode", ["fsdp2-offload", "fsdp2-offload-compile"])
def test_fsdp2_offload_puts_every_unit_on_the_host(mode):
    """On the CPU the host is the device, so the run above cannot tell offload from none: here every
    FSDP2 unit of the yardstick (each decoder layer, and the root) holds its shards under
    CPUOffloadPolicy (FSDP's own flag on each of its parameters)."""
    pytest.importorskip("transformers", reason="transformers is not installed: `make test` installs it")
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torchref.HFLoss(torchref.hf_model(registry.model_config("llama3-tiny", 256, n_layer=2), 0,
                                                  torch.device("cpu")))
        net, _, _ = torchref.build(mode, model, torch.device("cpu"), False)
        units = [m for m in net.modules() if hasattr(m, "_get_fsdp_state")]
        flags = [q.offload_to_cpu for u in units for q in u._get_fsdp_state()._fsdp_param_group.fsdp_params]
        assert len(units) == 3 and len(flags) == len(list(net.parameters())) and all(flags)
    finally:
        dist.destroy_process_group()


def test_deepspeed_yardstick_without_deepspeed_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # find_spec("deepspeed") is None: not installed
    code = cli.main(["bench", "train", "--model", "llama3-tiny", "-t", "64", "--torch", "fsdp2-offload,deepspeed-offload"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "install the deepspeed package" in err


def test_median_row_over_rounds():
    """--repeat: the run of median tokens/s and the median of the rounds' own ratios (the lower middle
    for an even count); a failed run fails the row, a round without a baseline run leaves no ratio."""
    run = lambda tps, ratio: {"variant": "v", "tokens_per_s": tps, "ratio": ratio}
    row = _median_row([run(300.0, 0.9), run(100.0, 0.5), run(200.0, 1.5)])  # the median run's own ratio: 1.5
    assert (row["tokens_per_s"], row["ratio"]) == (200.0, 0.9)
    assert row["runs_tokens_per_s"] == [300.0, 100.0, 200.0] and row["runs_ratio"] == [0.9, 0.5, 1.5]
    even = _median_row([run(200.0, 1.2), run(100.0, 1.1)])
    assert (even["tokens_per_s"], even["ratio"]) == (100.0, 1.1)
    assert _median_row([run(200.0, 1.2), run(100.0, None)])["ratio"] is None  # that round's baseline failed
    failed = _median_row([run(200.0, 1.0), {"variant": "v", "error": "boom", "ratio": None}])
    assert failed["error"] == "boom" and failed["ratio"] is None
    assert failed["runs_tokens_per_s"] == [200.0, None] and failed["runs_ratio"] == [1.0, None]


@pytest.mark.parametrize("repeat", [1, 2])
def test_rounds_keep_their_runs_apart(tmp_path, monkeypatch, capsys, repeat):
    """--keep DIR: a single round's runs in DIR itself (benchmarks/speed/two_gpu.sh reads them there),
    round k's in DIR/roundk; the second round runs the variants in reverse order; the baseline
    failing in one round fails its row, and no row gets a ratio."""
    folders, orders = [], []
    figures = {"mfu": None, "mem_gb": 1.0, "exposed_comm_frac": None, "comm_busbw_GBps": None, "slowest": 1.0, "loss": 5.0}

    def fake_round(_args, variants, _d, _n, _cuda, _label):
        cmd = next(c for name, c, _ in variants if name.startswith("braidtrain"))
        folders.append(Path(cmd[cmd.index("--out") + 1]).parent)
        orders.append([name for name, _, _ in variants])
        tps = {"braidtrain -z 1": 200.0 * len(folders), "torch ddp": 100.0}
        if len(folders) == 2:  # the baseline fails in round 2
            return [{"variant": name, "error": "boom", "ratio": None} if name == "torch ddp" else
                    dict(figures, variant=name, tokens_per_s=tps[name], ratio=None) for name, _, _ in variants]
        return [dict(figures, variant=name, tokens_per_s=tps[name], ratio=tps[name] / 100.0) for name, _, _ in variants]

    monkeypatch.setattr(bench, "_run_variants", fake_round)
    keep, out = tmp_path / "keep", tmp_path / "rows.json"
    code = cli.main(["bench", "train", "-i", str(tmp_path), "--nproc", "1", "--device", "cpu", "--layout", "-z 1",
                     "--torch", "ddp", "--baseline", "ddp", "--keep", str(keep), "--repeat", str(repeat), "--json", str(out)])
    rows = json.loads(out.read_text())
    assert folders == ([keep] if repeat == 1 else [keep / "round1", keep / "round2"])
    assert orders == [["braidtrain -z 1", "torch ddp"], ["torch ddp", "braidtrain -z 1"]][:repeat]
    assert [r["variant"] for r in rows] == ["braidtrain -z 1", "torch ddp"]
    if repeat == 1:
        assert code == 0 and [r["ratio"] for r in rows] == [2.0, 1.0] and "every run" not in capsys.readouterr().out
    else:
        assert code == 1 and rows[1]["error"] == "boom" and rows[0]["ratio"] is None
        assert rows[0]["runs_tokens_per_s"] == [200.0, 400.0] and "FAILED: boom" in capsys.readouterr().out


def test_slowest_step_against_the_median():
    assert slowest([0.2, 0.2, 0.2]) == 1.0
    assert slowest([0.20, 0.30, 0.20, 0.25, 0.60]) == pytest.approx(0.60 / 0.25)  # one stalled step


def test_gpu_load_counts_busy_gpus_only():
    """bench train's SM MHz and W: nvidia-smi's samples (utilization %, MHz, W) of busy GPUs only --
    not an idle GPU of the host, nor the job's start-up and compilation -- and none on a machine
    where nothing was busy."""
    lines = ["0, 1980, 76.7", f"{BUSY}, 1800, 690.0", "100, 1700, 700.0", "100, [N/A], 650.0", "99, 19"]
    assert gpu_load(lines) == {"sm_mhz": 1750.0, "power_w": 695.0}
    assert gpu_load(["0, 1980, 76.7", "5, 345, 80.1"]) == {} and gpu_load([]) == {}


@pytest.mark.parametrize("args, names", [
    (["comm", "--ops", "all_reduce,bogus"], "bogus"), (["comm", "--max-bytes", "12Q"], "12Q"),
    (["comm", "--min-bytes", "1M", "--max-bytes", "1K"], "--min-bytes"), (["train", "--torch", "ddp,jax"], "jax"),
    (["train", "--steps", "3", "--warmup", "3"], "--warmup 3"), (["train", "-i", "no/such/data"], "no/such/data"),
    (["train", "-b", "0"], "--batch-size"), (["train", "--nproc", "-1"], "--nproc"),
    (["train", "--layout", "-z '1"], "No closing quotation"), (["train", "--layout", "-z 7"], "stage 7"),
    (["train", "--repeat", "0"], "--repeat"), (["train", "--torch", "ddp", "--baseline", "fsdp2"], "--baseline fsdp2"),
    (["train", "--model", "llama3-tiny", "-t", "64", "--torch", "hf,hf-jax"], "hf-jax"), (["train", "--model", "llama4"], "llama4"),
    (["train", "--model", "llama3-tiny", "-t", "64", "--n-kv-heads", "3"], "n_kv_heads=3"),
    (["train", "--model", "llama3-tiny", "-t", "512"], "-t 512")])
def test_bench_bad_input_is_one_line(args, names):
    """One line that names what is wrong (not an error about something else, e.g. the missing default data)."""
    p = braidtrain("bench", *args, check=False)
    assert names in p.stderr, p.stderr
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and p.stderr.startswith("braidtrain: "
                                                                                           "error:"), p.stderr


def test_bench_train_fails_when_the_variants_do_other_work(shakespeare, monkeypatch, capsys):
    """A variant with another learning rate ends on another loss: bench train prints its table,
    then exits 2 with one line naming the two variants."""
    p = bench_train("--model", "tiny", "--n-layer", "2", "--n-embd", "64", "--n-head", "2",
                    "-i", shakespeare, "-b", "2", "-t", "64", "--steps", "2", "--warmup", "1", "--nproc", "1",
                    "--layout", "-z 0", "--layout", "-z 0 --lr 0.01", "--torch", "", monkeypatch=monkeypatch, capsys=capsys)
    err = [line for line in p.stderr.splitlines() if line.startswith("braidtrain: error:")]
    assert p.returncode == 2 and len(err) == 1, p.stderr[-3000:]
    assert "final losses disagree: braidtrain -z 0 --lr 0.01" in err[0] and "against braidtrain -z 0 " in err[0]
    assert "braidtrain -z 0 --lr 0.01" in p.stdout  # the table came first
