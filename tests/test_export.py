"""HuggingFace interchange: the name/shape mapping, a round trip, `export` and `--init-from` through
the CLI, the same logits as transformers' GPT2LMHeadModel (`make test` installs transformers), and
export's output and help naming the run's family, not GPT-2's alone."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from braidtrain.io import export
from braidtrain.model.gpt2 import GPT, GPTConfig
from braidtrain.parallel.placement import init_weights
from helpers import SMALL, braidtrain, metrics

# vocab 300 pads to 384: the export must cut the padding rows off and the import put them back
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=300)


def small_model(seed=3) -> GPT:
    m = GPT(CFG)
    init_weights(m, seed)
    with torch.no_grad():  # LayerNorms and biases start at 1 and 0: make them tell apart
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    return m.eval()


def test_mapping_and_round_trip(tmp_path):
    m = small_model()
    params = {k: v.detach().clone() for k, v in m.named_parameters()}
    export.write_hf(params, CFG, "bytes", tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert f.metadata() == {"format": "pt"}
    assert shapes["transformer.wte.weight"] == (300, 64)  # the real vocabulary
    assert shapes["transformer.h.1.attn.c_attn.weight"] == (64, 192)  # Conv1D: (in, out)
    assert shapes["transformer.h.0.mlp.c_proj.weight"] == (256, 64)
    assert "lm_head.weight" not in shapes and len(shapes) == len(params)
    c = json.loads((tmp_path / "config.json").read_text())
    assert (c["vocab_size"], c["n_positions"], c["n_embd"], c["n_layer"], c["n_head"]) == (300, 32, 64, 2, 2)
    assert (c["activation_function"], c["layer_norm_epsilon"], c["tie_word_embeddings"]) == ("gelu_new", 1e-5, True)
    back = export.load_hf(str(tmp_path), CFG)
    assert back.keys() == params.keys()
    for k, v in params.items():
        if k == "wte.weight":
            assert torch.equal(back[k][:300], v[:300]) and not back[k][300:].any()
        else:
            assert torch.equal(back[k], v), k


def test_same_logits_as_transformers(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: `make test` installs it")
    m = small_model()
    export.write_hf({k: v.detach() for k, v in m.named_parameters()}, CFG, "bytes", tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path)).eval()
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = m(x), hf(x).logits
    assert ours.shape == theirs.shape == (2, CFG.block_size, 300)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_export_and_init_from_through_the_cli(tmp_path, shakespeare):
    """Train, export, then start a new run from the export: its first loss (computed before any
    update) is the exported model's loss on that batch; mismatched sizes are one-line errors."""
    from braidtrain.io.data import Loader, TokenData, resolve_files

    run, hf = tmp_path / "run", tmp_path / "hf"
    base = [*SMALL, "-i", shakespeare, "-d", 512]
    braidtrain("train", *base, "-x", 3, "--out", run)
    out = braidtrain("export", run, "--format", "hf", "--out", hf).stdout
    assert "step_00000003" in out and "(HuggingFace GPT2LMHeadModel)" in out, out
    braidtrain("train", *base, "-x", 1, "--out", tmp_path / "again", "--init-from", hf)

    family, fields = export.read_config(str(hf))
    model_cfg = family.Config(**fields)
    model = GPT(model_cfg)
    model.load_state_dict(export.load_hf(str(hf), model_cfg))
    loader = Loader(TokenData(resolve_files(str(shakespeare), "train"), 256), 64, 8, 1337)
    with torch.no_grad():
        loss = sum(model(*loader.batch(0, first, 2)).item() for first in range(0, 8, 2)) / 512
    assert metrics(tmp_path / "again")[0]["loss"] == pytest.approx(loss, rel=1e-6)

    for extra, words in ((["--n-layer", 3], "disagrees with --init-from"), ([], "no config.json")):
        src = hf if extra else tmp_path
        p = braidtrain("train", *base, "-x", 1, "--out", tmp_path / "bad", "--init-from", src, *extra, check=False)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and words in p.stderr, p.stderr


def test_export_names_the_runs_family(tmp_path, shakespeare):
    """`export` of a Llama run says it wrote a LlamaForCausalLM (a GPT-2 run's GPT2LMHeadModel:
    test_export_and_init_from_through_the_cli), and the folder's config.json says the same."""
    run, hf = tmp_path / "run", tmp_path / "hf"
    braidtrain("train", "--model", "llama3-tiny", "--n-layer", "1", "-t", "32", "-b", "2", "-x", "1",
               "--val-every", "0", "--sample-tokens", "0", "--no-progress", "-i", shakespeare, "--out", run)
    out = braidtrain("export", run, "--out", hf).stdout
    assert "(HuggingFace LlamaForCausalLM) from" in out and "GPT" not in out, out
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("argv", [["--help"], ["export", "--help"], ["train", "--help"]])
def test_help_names_every_family_export_writes(argv, capsys):
    """export and --init-from are per family: their help names every architecture they write and
    read (export's and the top level's, no family alone)."""
    from braidtrain import cli
    from braidtrain.model import registry

    with pytest.raises(SystemExit):
        cli.main(argv)
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert argv[0] == "train" or "GPT-2" not in text, text
    for arch in (a for fam in registry.FAMILIES.values() for a in fam.ARCHITECTURES):
        assert arch in text, arch
