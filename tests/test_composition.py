"""Five axes on one mesh: the composition matrix on 8 CPU ranks (tests/layouts_worker.py "matrix",
one process group for the module). Each group is layouts of one model: its base trained straight
through, and every other layout trained to midway, checkpointed, then resumed from the midway
checkpoint another layout of the group wrote (layout-independent checkpoints across pp, dp, cp,
tp, ep and ZeRO) and trained on.

Default mode (4 steps, resumed at 2): pp2 x dp2 x tp2, pp2 x cp2 x dp2, dp2 x cp2 x tp2,
pp2 x dp4 at ZeRO-2 (ZeRO-3 is refused with a pipeline), tp2 x cp2 x pp2 against the single
process; dp4 x ep4 and pp2 x dp2 x ep2 with a mixture of experts against its single process --
every step's loss and gradient norm within 1e-5. Exact mode (4 steps, resumed at 2): each layout
bitwise equal -- every loss, gradient norm and the final weights -- to the base of its tp and cp
(1 process; tp 2; cp 2; dp2 x cp2 x tp2, trained straight through; the MoE model's single process
across ep)."""

import pytest

from helpers import assert_bitwise, assert_follows

DEFAULT = {"dense": ["pp2-dp2-tp2", "pp2-cp2-dp2", "dp2-cp2-tp2", "pp2-dp4-z2", "tp2-cp2-pp2"],
           "moe": ["dp4-ep4-z3", "pp2-dp2-ep2"]}
EXACT = {"tp1-cp1-exact": ("ref", ["pp2-dp4-z2"]), "tp2-exact": ("tp2", ["pp2-dp2-tp2"]),
         "cp2-exact": ("cp2", ["pp2-cp2-dp2"]), "tp2-cp2-exact": ("dp2-cp2-tp2", ["tp2-cp2-pp2"]),
         "moe-exact": ("ref", ["dp4-ep4-z3", "pp2-dp2-ep2"])}


@pytest.fixture(scope="module")
def runs(layout_suites):
    return layout_suites["matrix"]


def resumed(group: dict, names) -> None:
    """Each of names resumed from the midway checkpoint of the group's previous layout."""
    order = list(group)
    for name in names:
        assert group[name]["resumed_from"] == order[order.index(name) - 1], (name, group[name].get("resumed_from"))


@pytest.mark.parametrize("model", DEFAULT)
def test_each_layout_resumed_from_another_follows_the_single_process(runs, model):
    group = runs[model]
    assert set(group) == {"ref", *DEFAULT[model]}
    resumed(group, DEFAULT[model])
    ref = group["ref"]
    assert len(ref["losses"]) == 4 and all(len(group[n]["losses"]) == 4 for n in DEFAULT[model])
    assert_follows(group, DEFAULT[model], ref, 1e-5)


@pytest.mark.parametrize("name", EXACT)
def test_exact_mode_resumed_across_layouts_is_bitwise_at_a_fixed_tp_and_cp(runs, name):
    base, cells = EXACT[name]
    group = runs[name]
    assert set(group) == {base, *cells}
    resumed(group, cells)
    assert len(group[base]["losses"]) == 4
    assert_bitwise(group, cells, group[base])


def test_the_tp_and_cp_bases_differ_from_the_single_process_in_their_bits(runs):
    """What 'at a fixed tp and cp' means: splitting a matmul or attention changes the order of
    its sums, so the bases' bits differ from one another (if they did not, the bitwise checks
    above would prove less than they say), while agreeing to float rounding."""
    bases = [runs[g][EXACT[g][0]] for g in ("tp1-cp1-exact", "tp2-exact", "cp2-exact", "tp2-cp2-exact")]
    assert len({b["sha"] for b in bases}) == 4
    assert_follows(dict(enumerate(bases)), [1, 2, 3], bases[0], 1e-5, learns=0.0)
