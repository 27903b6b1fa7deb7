"""The model against an independent, plain implementation written here from the same weights."""

import math

import torch

from braidtrain.model.gpt2 import GPT, PRESETS
from braidtrain.parallel.placement import init_weights
from braidtrain.model.registry import model_config


def plain_gpt(sd: dict, idx: torch.Tensor, n_layer: int, n_head: int, vocab: int) -> torch.Tensor:
    """GPT-2 forward from a state dict, with explicit softmax attention and the tanh GELU formula."""

    def ln(x, w, b):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * w + b

    def gelu(x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    B, T = idx.shape
    x = sd["wte.weight"][idx] + sd["wpe.weight"][:T]
    C = x.shape[-1]
    hs = C // n_head
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(n_layer):
        p = lambda k: sd[f"h.{i}.{k}"]
        h = ln(x, p("ln_1.weight"), p("ln_1.bias"))
        qkv = h @ p("attn.c_attn.weight").T + p("attn.c_attn.bias")
        q, k, v = (t.reshape(B, T, n_head, hs).permute(0, 2, 1, 3) for t in qkv.split(C, -1))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).permute(0, 2, 1, 3).reshape(B, T, C)
        x = x + y @ p("attn.c_proj.weight").T + p("attn.c_proj.bias")
        h = ln(x, p("ln_2.weight"), p("ln_2.bias"))
        h = gelu(h @ p("mlp.c_fc.weight").T + p("mlp.c_fc.bias"))
        x = x + h @ p("mlp.c_proj.weight").T + p("mlp.c_proj.bias")
    x = ln(x, sd["ln_f.weight"], sd["ln_f.bias"])
    return (x @ sd["wte.weight"].T)[..., :vocab]


def test_logits_match_plain_implementation():
    torch.manual_seed(0)
    cfg = model_config("tiny", 300, n_layer=2)  # 300: the padding (to 384) must never be predicted
    model = GPT(cfg).double()
    init_weights(model, seed=3)
    with torch.no_grad():  # perturb so that biases and LayerNorm affine parameters matter too
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    idx = torch.randint(0, 300, (2, 17))
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    ref = plain_gpt(sd, idx, cfg.n_layer, cfg.n_head, 300)
    got = model(idx)
    assert got.shape == (2, 17, 300)
    assert torch.allclose(got, ref, rtol=1e-9, atol=1e-9), (got - ref).abs().max()
    # the summed loss is the plain cross-entropy over the real vocabulary
    y = torch.randint(0, 300, (2, 17))
    loss = model(idx, y)
    ref_loss = torch.nn.functional.cross_entropy(ref.reshape(-1, 300), y.reshape(-1), reduction="sum")
    assert torch.allclose(loss.double(), ref_loss, rtol=1e-6)  # the loss is taken in fp32


def test_initial_loss_is_near_uniform():
    for vocab in (256, 50257):
        cfg = model_config("tiny", vocab, n_layer=2)
        model = GPT(cfg)
        init_weights(model, seed=1)
        idx = torch.randint(0, vocab, (4, 64))
        y = torch.randint(0, vocab, (4, 64))
        with torch.no_grad():
            loss = model(idx, y).item() / y.numel()
        assert abs(loss - math.log(vocab)) < 0.1, (loss, math.log(vocab))


def test_init_is_layout_independent_and_gpt2_scaled():
    cfg = model_config("tiny", 256)
    a, b = GPT(cfg), GPT(cfg)
    init_weights(a, seed=5)
    init_weights(b, seed=5)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    # each parameter has its own stream: a parameter's values do not depend on the others
    assert not torch.equal(a.h[0].attn.c_attn.weight[:5, :5], a.h[1].attn.c_attn.weight[:5, :5])
    std = a.h[0].mlp.c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(2 * cfg.n_layer)) < 0.002
    assert abs(a.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.002
    assert torch.equal(a.h[0].ln_1.weight, torch.ones(cfg.n_embd)) and torch.equal(a.h[0].attn.c_attn.bias, torch.zeros(3 * cfg.n_embd))


def test_presets_have_gpt2_sizes():
    n = model_config("gpt2", 50257).num_params()
    assert abs(n - 124.48e6) < 0.1e6, n  # 124M with the vocabulary padded to 50304
    assert model_config("gpt2", 50257).padded_vocab == 50304
    assert model_config("d12", 50257) == model_config("gpt2", 50257)
    assert set(PRESETS) == {"tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"} | {f"d{d}" for d in (6, 12, 24, 36, 48, 60, 72, 84)}


def test_a_stack_of_experts_is_each_experts_own_init():
    """A layer's experts are stacked (one parameter per weight kind, dim 0 the experts), and each
    slice is the tensor that expert had as a parameter of its own: N(0, std) from the generator of
    its per-expert name (spelled here), on ep rank 1 of 2 its experts 2 and 3; its weights decay,
    its biases do not."""
    from types import SimpleNamespace

    from braidtrain.model import registry
    from braidtrain.model.protocol import param_seed
    from braidtrain.parallel.expert import Dispatch
    from braidtrain.parallel.placement import build

    def drawn(name, shape, std):
        return torch.empty(shape).normal_(0.0, std, generator=torch.Generator().manual_seed(param_seed(5, name)))

    mesh = SimpleNamespace(size=lambda axis: 1, coord=lambda axis: int(axis == "ep"))  # (ep rank 1)
    for preset, kind, shape, std in (("tiny", "c_proj.weight", (128, 512), 0.02 / math.sqrt(8)),
                                     ("mixtral-tiny", "gate_up_proj.weight", (352, 128), 0.02)):
        cfg = model_config(preset, 256, moe_experts=4)
        model = registry.build(cfg, mesh, dispatch=Dispatch(SimpleNamespace(size=2)))
        init_weights(model, seed=5)
        prefix = "h" if preset == "tiny" else "layers"
        stack = model.get_parameter(f"{prefix}.1.mlp.experts.{kind}")
        assert stack.shape == (2, *shape), stack.shape
        for j, e in enumerate((2, 3)):
            assert torch.equal(stack[j], drawn(f"{prefix}.1.mlp.experts.{e}.{kind}", shape, std)), (preset, e)
    table = build(GPT(model_config("tiny", 256, moe_experts=4)))
    assert table["h.0.mlp.experts.c_fc.weight"].decays and not table["h.0.mlp.experts.c_fc.bias"].decays
