"""Context parallelism. In one 8-rank process group (tests/layouts_worker.py): ring and
all-gather attention against torch's on the whole sequence (forward and q/k/v gradients, cp 2
and 4, zigzag and contiguous chunks), the block pairs each rank computes, the ring's transfers
launched before each step's attention ends; then many layouts of one GPT on the same global
batches -- cp 2 and 4, zigzag and contiguous, with dp, ZeRO, tp (sp) and pp; 4 steps -- against
the single process (within 1e-5) and, in exact mode at cp 2, to the bit across dp, ZeRO and pp. Then the command line: a cp 2 run
that validates, samples and saves, resumed at cp 1; and bad input."""


import pytest

from helpers import SMALL, assert_bitwise, assert_follows, braidtrain, metrics
from braidtrain.parallel import context


@pytest.fixture(scope="module")
def runs(layout_suites):
    return layout_suites["cp"]


def test_ring_and_allgather_attention_match_torchs_on_the_whole_sequence(runs):
    checks = {k: v for k, v in runs.items() if k.startswith("attention")}
    assert len(checks) == 8
    for name, r in checks.items():
        assert r["err"] <= 1e-5, (name, r)
    # bf16 in and out (fp32 inside): within bf16's rounding of the fp32 reference on the same inputs
    assert runs["bf16-attention-cp2-ring-zigzag"]["err"] <= 2e-2


def test_zigzag_balances_the_block_pairs_and_contiguous_does_not(runs):
    for cp in (2, 4):
        for impl in ("ring", "allgather"):
            assert runs[f"attention-cp{cp}-{impl}-zigzag"]["pairs"] == [2 * cp + 1] * cp
            assert runs[f"attention-cp{cp}-{impl}-contiguous"]["pairs"] == [4 * r + 3 for r in range(cp)]
    # and over training (every block's forward, every micro-batch): equal, or 3 : 7 when contiguous
    assert len(set(runs["cp2"]["pairs"])) == 1
    a, b = runs["cp2-contiguous"]["pairs"]
    assert 7 * a == 3 * b


def test_the_ring_launches_the_next_transfer_before_the_attention_ends(runs):
    for cp in (2, 4):
        assert runs[f"attention-cp{cp}-ring-zigzag"]["overlap"] is True


def test_every_layout_matches_the_single_process(runs):
    ref = runs["ref"]
    default = [k for k in runs if k.startswith("cp") and not k.endswith("exact")]
    assert len(default) == 5
    assert_follows(runs, default, ref, 1e-5)


def test_exact_mode_at_cp_2_is_bitwise_across_dp_zero_and_pp(runs):
    """Ring: dp 1, 2, 4, ZeRO 0, 1, 3 (with pp: test_composition.py); all-gather (its own bits: the backward's sums of dK, dV
    run in another order) across dp 1, 2 and ZeRO 0, 3."""
    for ref, others in (("cp2-exact", [k for k in runs if k.endswith("exact") and "allgather" not in k]),
                        ("cp2-allgather-exact", ["cp2-dp2-z3-allgather-exact"])):
        others = [k for k in others if k != ref]
        assert len(others) == (3 if ref == "cp2-exact" else 1)
        assert_bitwise(runs, others, runs[ref])
    assert runs["cp2-allgather-exact"]["losses"][0] == runs["cp2-exact"]["losses"][0]  # the same forward


def test_the_split_of_a_sequence():
    """Rank r holds chunks r and 2cp-1-r (zigzag) or 2r and 2r+1; together every position once."""
    assert context.chunks_of(4, 1) == (1, 6) and context.chunks_of(4, 1, "contiguous") == (2, 3)
    for order in context.ORDERS:
        idx = sorted(i for r in range(4) for i in context.token_index(16, 4, r, order).tolist())
        assert idx == list(range(16))
    assert context.token_index(8, 2, 0).tolist() == [0, 1, 6, 7]


CP_MODEL = [*SMALL, "--n-layer", "2", "-d", "512", "--val-every", "2", "--val-steps", "1", "--sample-tokens", "8"]


def test_a_cp_run_validates_samples_and_resumes_at_cp_1(tmp_path, shakespeare):
    """cp 2 (ring, 2 ranks): the single process's losses and validation losses to 1e-5; it
    samples; its checkpoint resumed on one process trains on as the single process does."""
    one, two = tmp_path / "one", tmp_path / "two"
    q = braidtrain("train", *CP_MODEL, "-i", shakespeare, "-x", 4, "--ckpt-every", 2, "--out", one)
    p = braidtrain("train", *CP_MODEL, "-i", shakespeare, "-x", 4, "--ckpt-every", 2, "--out", two, "--cp", 2, nproc=2)
    assert "cp 2 (ring, zigzag)" in p.stdout
    for key in ("loss", "val_loss"):
        a = [r[key] for r in metrics(one) if key in r]
        b = [r[key] for r in metrics(two) if key in r]
        assert len(a) == len(b) > 0 and all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b)), (key, a, b)
    sample = lambda out: out.split("--- sample ---\n")[1].split("\n-----")[0]
    assert sample(p.stdout) == sample(q.stdout)  # the same tokens as the single process's (whole sequences)
    p = braidtrain("train", *CP_MODEL, "-i", shakespeare, "-x", 6, "--out", two, "--resume", "auto")
    assert "cp 2 -> 1" in p.stdout, p.stdout
    braidtrain("train", *CP_MODEL, "-i", shakespeare, "-x", 6, "--out", one, "--resume", "auto")
    after = lambda run: [r for r in metrics(run) if r.get("step", 0) > 4 and "grad_norm" in r]
    a, b = after(one), after(two)
    assert [r["step"] for r in b] == [5, 6]
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm"):
            assert abs(x[key] - y[key]) <= 1e-5 * abs(x[key]), (key, a, b)
