"""Run under torchrun (4 ranks) by test_eval.py: score an eval file with the examples dealt to
1, 2 and 4 of the ranks (the others add 0 to the sums), with a small GPT, one with experts at a
capacity (evaluation routes dropless) and with a bigram stub;
write each world size's totals to OUT/rank<r>.json."""

import json
import sys

import torch

from braidtrain.evaluate import read_evalfile, score, totals
from braidtrain.model.gpt2 import GPT
from braidtrain.parallel.placement import init_weights
from braidtrain.model.registry import model_config
from braidtrain.collective.comm import Comm
from braidtrain.collective.mesh import build_mesh
from braidtrain.collective.runtime import init_runtime


def main(path, out):
    rt = init_runtime("env")
    comm = Comm(rt.device)
    group = build_mesh(rt.rank, rt.world_size, comm).groups["world"]
    examples = read_evalfile(path)
    model = GPT(model_config("tiny", 256, n_layer=2, n_embd=32, n_head=2, block_size=16)).eval()
    init_weights(model, seed=3)
    moe = GPT(model_config("tiny", 256, n_layer=2, n_embd=32, n_head=2, block_size=16, moe_experts=4,
                           moe_capacity=0.5)).eval()  # a capacity that drops in training
    init_weights(moe, seed=3)
    table = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    res = {}
    for name, logits_of in (("gpt", model), ("moe", moe), ("bigram", lambda x: table[x])):
        for world in (1, 2, 4):
            mine = score(logits_of, examples, rank=rt.rank, world=world, block_size=16, vocab=256) if rt.rank < world else [0, 0]
            res[f"{name}/{world}"] = totals(mine, len(examples), lambda v: comm.ordered_sum(v, group))
    with open(f"{out}/rank{rt.rank}.json", "w") as f:
        json.dump(res, f)
    rt.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
