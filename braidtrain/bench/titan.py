"""`bench train --torch titan|titan-fp8`: torchtitan's own Llama, built from its pieces.

torchtitan is what a user who trains Llama on Hopper picks, so it is the yardstick that matters
most. Its trainer needs a TOML job and its data stack; this builds the same model the way its
trainer does, from its own modules, at braidtrain's preset shapes:

    dense     torchtitan.models.llama3's Transformer (SDPA attention, its RoPE, an `output` head
              always untied: where the preset ties it, as Llama-3.2's do, torchtitan trains a
              head of its own, started from the embedding), holding braidtrain's initial weights
              (export.to_hf, then its own Llama3StateDictAdapter.from_hf), so the losses agree
              with braidtrain's run (a tied preset's to the head's own updates)
    mixture   torchtitan.models.llama4's Transformer with its MoE in every block (its token-choice
              router, grouped GEMM experts, no shared expert, softmax scores) at the preset's
              experts, top k and expert width; its own initialisation (no adapter from ours)
    titan-fp8 its Float8LinearConverter (torchao's convert_to_float8_training, tensorwise, the
              `output` head filtered out as its llama3 float8 configs do), before parallelising

then its trainer's order: `apply_compile` (each block, fullgraph; on CUDA only -- on the CPU the
same model runs eagerly, which is what the CPU test checks), `apply_fsdp` on a mesh over all the
ranks (one rank: a one-rank mesh; bf16 parameters, fp32 reduction, no autocast), its loss --
cross-entropy summed in fp32, torch.compile'd as its "loss" component -- over the global token count,
torch's fused AdamW (its `implementation = "fused"`), clipping at braidtrain's setting.

torchtitan (0.2.2: 0.3.0 does not import on torch 2.11) is not a dependency. Its package
__init__s import the trainer's stack (datasets, torchdata, tokenizers' download paths): `load()`
registers empty packages for the model folders and for `protocols.train_spec` (the model files
take only ModelProtocol from it), so just the model, parallelize and float8 modules import. What
they need besides torch: tyro, docstring_parser, typeguard (its config), torchao (float8 only).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch

from braidtrain.errors import UserError

MODES = ("titan", "titan-fp8")
VERSION = "0.2.2"  # the version these calls were written against


def load():
    """The torchtitan modules this uses, imported without its trainer's stack: a namespace of them."""
    try:
        import torchtitan
        import torchtitan.protocols.model as protocol
    except ImportError as e:
        raise UserError(f"--torch titan needs torchtitan {VERSION} and its config's packages (tyro, docstring_parser, "
                        f"typeguard; torchao for titan-fp8): pip install torchtitan=={VERSION} tyro ({e})") from None
    root = Path(torchtitan.__file__).parent
    for pkg in ("models.llama3", "models.llama4"):  # their __init__s build TrainSpecs: dataloaders, tokenizers
        name = f"torchtitan.{pkg}"
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__path__ = [str(root / pkg.replace(".", "/"))]
            sys.modules[name] = stub
    if "torchtitan.protocols.train_spec" not in sys.modules:
        spec = types.ModuleType("torchtitan.protocols.train_spec")
        spec.ModelProtocol = protocol.ModelProtocol  # all the model files take from it
        sys.modules[spec.__name__] = spec
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.infra import parallelize as p3
    from torchtitan.models.llama3.model import args as a3, model as m3, state_dict_adapter
    from torchtitan.models.llama4.infra import parallelize as p4
    from torchtitan.models.llama4.model import args as a4, model as m4
    from torchtitan.models.moe.moe import MoEArgs
    return types.SimpleNamespace(JobConfig=JobConfig, ParallelDims=ParallelDims, p3=p3, a3=a3, m3=m3,
                                 adapter=state_dict_adapter.Llama3StateDictAdapter, p4=p4, a4=a4, m4=m4,
                                 MoEArgs=MoEArgs)


def model_args(tt, mcfg, seq_len: int, device):
    """torchtitan's TransformerModelArgs of braidtrain's model config mcfg (a Llama preset)."""
    if getattr(mcfg, "family", None) != "llama3" or mcfg.qk_norm or mcfg.moe_shared:
        raise UserError("--torch titan builds torchtitan's Llama 3 and Llama 4 MoE: a Llama without qk-norm or shared "
                        "experts (a llama3* or mixtral-* preset)")
    shape = dict(dim=mcfg.n_embd, n_layers=mcfg.n_layer, n_heads=mcfg.n_head, n_kv_heads=mcfg.kv_heads,
                 vocab_size=mcfg.vocab_size, norm_eps=mcfg.norm_eps, rope_theta=mcfg.rope_theta, max_seq_len=seq_len)
    scaling = (tt.a3.RoPEScalingArgs(mcfg.rope_factor, mcfg.rope_low_freq, mcfg.rope_high_freq, mcfg.rope_original)
               if mcfg.rope_factor else None)
    if mcfg.moe_experts:
        moe = tt.MoEArgs(num_experts=mcfg.moe_experts, num_shared_experts=0, top_k=mcfg.moe_top_k,
                         score_func="softmax", route_norm=mcfg.moe_renorm, use_grouped_mm=device.type == "cuda")
        # its expert width: 2/3 of 4 dim, rounded up to multiple_of -- set so that it comes out at ours
        width = mcfg.moe_width
        return tt.a4.TransformerModelArgs(**shape, multiple_of=width,
                                          ffn_dim_multiplier=width / int(8 * mcfg.n_embd / 3),
                                          moe_args=moe, auto_scale_hidden_dim=False, interleave_moe_layer_step=1,
                                          rope_scaling_args=scaling, every_n_layers_nope=None)
    # 0 scaling in ours is none; its llama3 always scales, by 1 when the factor is 1 (same frequencies)
    scaling = scaling or tt.a3.RoPEScalingArgs(1.0, 1.0, 4.0, seq_len)
    width = mcfg.mlp_width
    return tt.a3.TransformerModelArgs(**shape, multiple_of=width, ffn_dim_multiplier=width / int(8 * mcfg.n_embd / 3),
                                      rope_scaling_args=scaling)


class TitanLoss(torch.nn.Module):
    """torchtitan's model and loss: forward(x, y) is the summed cross-entropy of its logits."""

    def __init__(self, model, loss_fn):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, x, y):
        return self.loss_fn(self.model(x), y)


def build(mode: str, mcfg, seq_len: int, device, seed: int, world: int, compile: bool | None = None) -> TitanLoss:
    """torchtitan's model at mcfg's shape on `device`, converted, compiled (by default on CUDA
    only) and sharded over the `world` ranks the way its trainer does it (the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh

    tt = load()
    args = model_args(tt, mcfg, seq_len, device)
    moe = bool(mcfg.moe_experts)
    job = tt.JobConfig()
    job.compile.enable = device.type == "cuda" if compile is None else compile
    job.training.seq_len = seq_len
    dims = tt.ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world)
    with torch.device("meta"):
        model = (tt.m4 if moe else tt.m3).Transformer(args)
    if mode == "titan-fp8":
        from torchtitan.components.quantization.float8 import Float8LinearConverter

        job.model.converters = ["float8"]
        job.quantize.linear.float8.filter_fqns = ["output"]  # as its llama3 float8 configs: the head stays bf16
        job.quantize.linear.float8.emulate = device.type != "cuda"  # (the CPU test: torchao's emulation)
        Float8LinearConverter(job, dims).convert(model)
    infra = tt.p4 if moe else tt.p3
    if job.compile.enable:
        if moe:
            infra.apply_compile(model, job.compile, ep_enabled=False)
        else:
            infra.apply_compile(model, job.compile)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    kw = dict(param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, reduce_dtype=torch.float32,
              pp_enabled=False)
    if moe:
        infra.apply_fsdp(model, mesh, **kw, ep_degree=1)
    else:
        infra.apply_fsdp(model, mesh, **kw)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
        if not moe:  # braidtrain's initial weights, through torchtitan's own HuggingFace adapter
            _load_ours(tt, model, args, mcfg, seed)
    from torchtitan.components.loss import cross_entropy_loss

    loss_fn = torch.compile(cross_entropy_loss) if job.compile.enable else cross_entropy_loss
    return TitanLoss(model, loss_fn)


def _load_ours(tt, model, args, mcfg, seed: int) -> None:
    """braidtrain's initial weights of `seed` into torchtitan's sharded model: ours built on the
    host, written as `export --format hf` would, read by its Llama3StateDictAdapter.from_hf."""
    from torch.distributed.tensor import distribute_tensor

    from braidtrain.io import export
    from braidtrain.model import registry
    from braidtrain.parallel.placement import init_weights

    ours = registry.build(mcfg)
    init_weights(ours, seed)
    hf = export.to_hf({n: p.detach() for n, p in ours.named_parameters()}, mcfg)
    state = tt.adapter(args, None).from_hf(hf)
    if mcfg.tied:  # its head is a tensor of its own (untied, as in all its llama3 models): ours to start from
        state["output.weight"] = state["tok_embeddings.weight"].clone()
    # (a compiled block is torch.compile's wrapper: its parameters' names hold `_orig_mod.`)
    params = {n.replace("._orig_mod", ""): p for n, p in model.named_parameters()}
    if set(state) != set(params):
        raise RuntimeError(f"torchtitan's model and braidtrain's weights differ: "
                           f"{sorted(set(state) ^ set(params))[:4]}")
    for name, p in params.items():
        p.copy_(distribute_tensor(state[name].to(p.dtype), p.device_mesh, p.placements).to(p.device))
