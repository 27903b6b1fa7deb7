"""The Llama-3 family (model/llama.py) on the protocol every family shares: the same logits as
transformers' LlamaForCausalLM (grouped-query attention, Llama-3.1's scaled RoPE; tied and untied)
and an exact round trip of its HuggingFace folder; in one 8-rank process group (tests/layouts_worker.py
"llama"), llama3-tiny on every axis against the single process (1e-5, loss and gradient norm, 4
steps) and, in exact mode (3 steps), to the bit across dp 1/2/4, ZeRO 0-3 and pipeline schedules; then the
command line: the preset's Llama 3 recipe named at the start, export and --init-from, an exact run
stopped and resumed on another layout, the planner's verdicts on Llama-3.1-70B, and bad input, one line each."""

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from braidtrain.io import export
from braidtrain.errors import UserError
from braidtrain.model import registry
from braidtrain.parallel.placement import init_weights
from helpers import assert_bitwise, assert_follows, braidtrain, metrics, summary
from test_cli import assert_one_line_error

# GQA: 4 query heads over 2 key/value heads; vocabulary 300 pads to 384 (cut on export, zeros on import)
SHAPE = dict(n_layer=2, n_embd=64, n_head=4, n_kv_heads=2)
MODEL = ["--model", "llama3-tiny", "--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--n-kv-heads", "2",
         "-t", "64", "-b", "2", "--val-every", "0", "--sample-tokens", "0", "--no-progress"]


@pytest.fixture(scope="module")
def runs(layout_suites):
    return layout_suites["llama"]


def test_every_axis_matches_the_single_process(runs):
    """dp 2 at ZeRO 1 and 3, tp 2 with sp, pp 2 (1f1b and zb), cp 2, and on 8 ranks pp 2 x tp 2 x dp 2
    and pp 2 x cp 2 x dp 2; the tied head (Llama-3.2's) on pp 2 x dp 2, its two copies equal."""
    default = [k for k in runs if not k.startswith("ref") and not k.endswith("exact")]
    assert len(default) == 9
    assert_follows(runs, [k for k in default if not k.startswith("tied")], runs["ref"], 1e-5)
    assert_follows(runs, ["tied-pp2-dp2"], runs["ref-tied"], 1e-5)
    tied = runs["tied-pp2-dp2"]
    # each replica's first stage's embedding, the last's copy
    assert tied["wte_copies"] == 4 and tied["wte_copies_equal"]
    assert runs["pp2-1f1b"]["wte_copies"] == 0  # (untied: no copy)
    assert runs["ref"]["losses"] != runs["ref-tied"]["losses"]  # (two models)


def test_exact_is_bitwise_across_dp_zero_and_pipelines(runs):
    exact = [k for k in runs if k.endswith("-exact") and not k.startswith(("ref", "tied"))]
    assert len(exact) == 6
    assert_bitwise(runs, exact, runs["ref-exact"])
    assert_bitwise(runs, ["tied-pp2-interleaved-exact"], runs["ref-tied-exact"])


def small(vocab=300, preset="llama3-tiny", **kw):
    cfg = registry.model_config(preset, vocab, **{**SHAPE, **kw})
    m = registry.build(cfg)
    init_weights(m, 3)
    with torch.no_grad():  # the norms start at 1: make them tell apart
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    return cfg, m.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_same_logits_as_transformers_and_an_exact_round_trip(tmp_path, tied):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: `make test` installs it")
    cfg, m = small(tie_embeddings=tied)
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    export.write_hf(params, cfg, "bytes", tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLM"] and c["num_key_value_heads"] == 2
    assert c["rope_scaling"]["rope_type"] == "llama3" and c["rope_scaling"]["factor"] == 8.0
    assert c["tie_word_embeddings"] is tied and c["intermediate_size"] == cfg.mlp_width
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    x = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(0))  # past the 64 unscaled positions
    with torch.no_grad():
        ours, theirs = m(x), hf(x).logits
    assert ours.shape == theirs.shape == (2, 96, 300)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    family, fields = export.read_config(str(tmp_path))  # (HF's width is the rounded one: ffn_hidden)
    assert family.Config(**fields) == replace(cfg, ffn_hidden=cfg.mlp_width, ffn_multiplier=1.0, multiple_of=256)
    back = export.load_hf(str(tmp_path), cfg)
    assert back.keys() == params.keys()
    for k, v in params.items():
        if k in ("embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(back[k][:300], v[:300]) and not back[k][300:].any()
        else:
            assert torch.equal(back[k], v), k


# the Llama family's other shapes HF names: a qk-norm (Qwen3), SwiGLU experts (Mixtral: softmax over
# the top-2; Qwen3-MoE: softmax, top-k, not renormalised here, a dense layer between sparse ones)
HF_SHAPES = {"Qwen3ForCausalLM": ("llama3-tiny", dict(qk_norm=True)),
             "MixtralForCausalLM": ("mixtral-tiny", dict(moe_hidden=48)),
             "Qwen3MoeForCausalLM": ("mixtral-tiny", dict(qk_norm=True, moe_experts=8, moe_top_k=4, moe_hidden=16,
                                                          moe_every=2, moe_renorm=False))}


@pytest.mark.parametrize("arch", HF_SHAPES)
def test_qwen3_mixtral_and_qwen3_moe_both_ways(tmp_path, arch):
    """The same logits as transformers' model of the architecture the config makes (1e-4; the
    experts routed dropless, as HF routes), an exact round trip of our folder, and HF's own folders
    read back to the same tensors: save_pretrained's (per-expert names) and the model's state dict
    as it is in memory (transformers 5 fuses the experts: experts.gate_up_proj, experts.down_proj)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: `make test` installs it")
    preset, kw = HF_SHAPES[arch]
    cfg, m = small(preset=preset, **kw)
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    export.write_hf(params, cfg, "bytes", tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["architectures"] == [arch]
    hf = getattr(transformers, arch).from_pretrained(str(tmp_path / "ours")).eval()
    x = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = m(x), hf(x).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    hf.save_pretrained(str(tmp_path / "theirs"))
    (tmp_path / "fused").mkdir()
    shutil.copy(tmp_path / "theirs" / "config.json", tmp_path / "fused")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "fused" / "model.safetensors"))
    family, fields = export.read_config(str(tmp_path / "theirs"))
    assert family.Config(**fields).moe_experts == cfg.moe_experts and family.Config(**fields).qk_norm == cfg.qk_norm
    for folder in ("ours", "theirs", "fused"):
        back = export.load_hf(str(tmp_path / folder), cfg)
        assert back.keys() == params.keys()
        for k, v in params.items():
            n = 300 if k in ("embed_tokens.weight", "lm_head.weight") else len(v)
            assert torch.equal(back[k][:n], v[:n]), (folder, k)


def test_export_init_from_and_an_exact_resume_on_another_layout(tmp_path, shakespeare):
    """Through the command line: an exact llama3-tiny run of 6 steps on one process, saved at 3;
    its copy as it was after step 3 resumed by 2 processes at ZeRO-3 ends with the same weights.
    The export of the finished run starts a new run whose first loss is the exported model's; a
    GPT-2 run's checkpoint into a Llama run is one line."""
    base = [*MODEL, "-i", shakespeare, "-d", 512, "--exact"]
    full = tmp_path / "full"
    p = braidtrain("train", *base, "-x", 6, "--ckpt-every", 3, "--out", full)
    assert ("recipe: braidtrain tiny (lr 2e-3 (4e-3 at the recipe's 2048 tokens a step, x sqrt(512/2048)), warmup 3 "
            "of 6 steps, scaled from 50, cosine to 5%, clip 1.0, AdamW 0.9/0.95 wd 0.1) from preset llama3-tiny\n"
            ) in p.stdout  # (test_recipes.py: the recipe's resolution)
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_00000006")
    (cut / "summary.json").unlink()
    p = braidtrain("train", *base, "-x", 6, "-z", 3, "--out", cut, "--resume", "auto", nproc=2)
    assert "resumed from" in p.stdout and "step_00000003" in p.stdout
    assert summary(cut)["weights_sha256"] == summary(full)["weights_sha256"]
    assert [r["loss"] for r in metrics(cut)] == [r["loss"] for r in metrics(full)]
    meta = json.loads((full / "checkpoints" / "step_00000006" / "meta.json").read_text())
    assert meta["family"] == "llama3" and meta["model"]["n_kv_heads"] == 2

    hf = tmp_path / "hf"
    braidtrain("export", full, "--format", "hf", "--out", hf)
    again = tmp_path / "again"
    braidtrain("train", *base, "-x", 1, "--out", again, "--init-from", hf)
    family, fields = export.read_config(str(hf))
    cfg = family.Config(**fields)
    model = registry.build(cfg)
    model.load_state_dict(export.load_hf(str(hf), cfg))
    from braidtrain.io.data import Loader, TokenData, resolve_files

    loader = Loader(TokenData(resolve_files(str(shakespeare), "train"), 256), 64, 8, 1337)
    with torch.no_grad():
        loss = sum(model(*loader.batch(0, first, 2)).item() for first in range(0, 8, 2)) / 512
    assert metrics(again)[0]["loss"] == pytest.approx(loss, rel=1e-6)

    gpt = tmp_path / "gpt"  # a GPT-2 run's directory, resumed as a Llama: one line
    braidtrain("train", "--model", "tiny", "--n-layer", "1", "-t", "64", "-b", "2", "-i", shakespeare, "-d", 128,
               "-x", 1, "--val-every", "0", "--sample-tokens", "0", "--no-progress", "--out", gpt)
    p = braidtrain("train", *base, "-x", 2, "--out", gpt, "--resume", "auto", check=False)
    assert_one_line_error(p, "holds a gpt2 model", "llama3")


def test_bad_input_is_one_line(tmp_path, shakespeare):
    p = braidtrain("train", *MODEL, "--n-kv-heads", "3", "-i", shakespeare, "-x", 1, "--out", tmp_path / "r", check=False)
    assert_one_line_error(p, "n_head=4 is not divisible by n_kv_heads=3", "{1,2,4}")
    with pytest.raises(UserError, match=r"^tp=4 does not divide n_kv_heads=2 .*whole key/value heads.*use tp in "
                                        r"\{1,2\}$"):
        registry.model_config("llama3-tiny", 256, **SHAPE).check_tp(4)
    with pytest.raises(UserError, match="is not a setting of the gpt2 family"):
        registry.model_config("gpt2", 256, n_kv_heads=2)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    with pytest.raises(UserError, match="MambaForCausalLM.*is not one braidtrain trains.*LlamaForCausalLM"):
        export.read_config(str(tmp_path / "hf"))


def test_counts_are_metas_published_sizes():
    """Parameter counts of the presets, from the models themselves, against Meta's model cards."""
    billions = {"llama3.2-1b": 1.24, "llama3.2-3b": 3.21, "llama3.1-8b": 8.03, "llama3.1-70b": 70.55, "llama3.1-405b": 405.85}
    for name, n in billions.items():
        cfg = registry.model_config(name)
        assert cfg.vocab_size == 128256 and abs(cfg.num_params() / 1e9 - n) < 0.01, (name, cfg.num_params())
    assert [registry.model_config(n).mlp_width for n in ("llama3.2-1b", "llama3.1-8b", "llama3.1-70b", "llama3.1-405b")] \
        == [8192, 14336, 28672, 53248]  # Llama's rounding of 8/3 n_embd


def test_the_planners_verdicts_on_llama_70b():
    """`plan --model llama3.1-70b --gpus 64 --gpu-mem 80` (t 1024, 0.5M tokens a step), with its own
    counts: plain data parallelism does not fit (16 bytes a parameter on every GPU), ZeRO-3 does,
    and so do TP 8 + ZeRO-2 and the textbook's TP 8 + ZeRO-1: a bf16 run's lean state holds Megatron-
    LM's 2 + 4 + 12/N bytes a matrix element at ZeRO-1 (bf16 weights, the fp32 gradient buffer, the
    fp32 master with m and v sharded; parallel/buckets.py) -- fp32 weights and their 8 + 8/N did not."""
    from braidtrain.plan.estimate import estimate
    from braidtrain.plan.memory import param_counts
    from braidtrain.plan.search import plan
    from braidtrain.plan.space import Candidate, Setup

    s = Setup(registry.model_config("llama3.1-70b"), gpus=64, mem_gb=80, t=1024, d=524288)
    est = lambda **kw: estimate(s, Candidate(kw.pop("dp"), kw.pop("zero"), 1, True, **kw))
    ddp, zero3, tp8_z2, tp8_z1 = est(dp=64, zero=0), est(dp=64, zero=3), est(dp=8, zero=2, tp=8), est(dp=8, zero=1, tp=8)
    assert not ddp["fits"] and ddp["mem"]["total"] > 16 * 70e9
    assert zero3["fits"] and tp8_z2["fits"] and tp8_z1["fits"]
    counts = param_counts(s.cfg, 8)
    P, M = counts["rank"], counts["matrices"]
    state = tp8_z1["state"]  # ZeRO-1's gradient buffer whole; the blocks' matrices in bf16, masters sharded
    assert (state["params"], state["grads"], state["optimizer"]) == (4 * P - 2 * M, 4 * P, (8 * P + 4 * M) // 8)
    for name in ("llama3.2-1b", "llama3.1-8b", "llama3.1-405b"):  # the presets plan
        rows = plan(Setup(registry.model_config(name), gpus=8, mem_gb=80, t=2048, d=8 * 2048 * 8), pps=(1,),
                         cps=(1,), tps=(1, 8), variants=False)
        assert rows["rows"] and "recommended" in rows["recommendation"] or "nothing fits" in rows["recommendation"]


def test_plan_check_of_a_llama_layout(tmp_path, shakespeare, monkeypatch):
    """`plan --check` on the CPU: a real run of llama3-tiny at tp 2 with sp and ZeRO-1 on 2 processes
    holds the model state the planner estimates, within 5% (its family reaches the check's run
    through the preset and train's flags: registry.command_line)."""
    from braidtrain.plan import check
    from braidtrain.plan.command import setup_from
    from helpers import forked
    from test_plan import parse

    monkeypatch.setattr(check, "run_job", forked)
    monkeypatch.delenv("RANK", raising=False)
    args = parse("--model", "llama3-tiny", "--vocab", 256, "--gpus", 2, "-t", 64, "-d", 256, "--check", "1,2",
                 "--tp", 2, "--sp", "--data", shakespeare)
    r = check.check(setup_from(args), check.check_layout(args), str(shakespeare), None)
    assert r["layout"]["tp"] == 2 and r["layout"]["zero"] == 1 and abs(r["rel_error"]) < 0.05, r
