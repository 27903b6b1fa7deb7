"""Multiple-choice evaluation (braidtrain/evaluate.py): llm.c's eval file read and written, the
scores against a hand computation, the counts over 1, 2 and 4 ranks, and the command line end to
end (train --eval-data, braidtrain eval, data prepare-eval, bad input)."""

from __future__ import annotations

import json
import math
import random
import struct
from pathlib import Path

import pytest
import torch

from braidtrain import cli
from braidtrain.errors import UserError
from braidtrain.evaluate import Example, read_evalfile, score, totals, write_evalfile
from helpers import ROOT, SMALL, braidtrain, launch, metrics, summary

FIXTURE = ROOT / "tests" / "fixtures" / "tiny_eval.bin"  # data prepare-eval --tokenizer bytes of its .jsonl
JSONL = FIXTURE.with_suffix(".jsonl")


def llmc_file(examples) -> bytes:
    """An eval file laid out by hand from llm.c's write_evalfile (dev/data/data_common.py):
    examples are (label, context tokens, [completion tokens, ...])."""
    records = []
    for i, (label, ctx, ends) in enumerate(examples):
        fields = [i, label, len(ends), len(ctx), *ctx]
        for e in ends:
            fields += [len(e), *e]
        records.append(struct.pack(f"<{len(fields) + 2}H", 0xFFFF, 2 * (len(fields) + 2), *fields))
    head = struct.pack("<256i", 20240522, 1, len(examples), max(map(len, records)), *[0] * 252)
    return head + b"".join(records)


def random_examples(n, vocab, seed):
    """Contexts of 1-20 tokens, 2-4 completions of 1-6 tokens (short and long: the mean and the
    sum pick differently)."""
    g = random.Random(seed)
    out = []
    for _ in range(n):
        ends = [[g.randrange(vocab) for _ in range(g.randint(1, 6))] for _ in range(g.randint(2, 4))]
        out.append((g.randrange(len(ends)), [g.randrange(vocab) for _ in range(g.randint(1, 20))], ends))
    return out


def by_hand(table: list[list[float]], examples) -> tuple[int, int]:
    """Correct counts (by mean, by sum) of a model whose next-token logits are table[previous token]."""
    def logp(prev, nxt):
        row = table[prev]
        return row[nxt] - math.log(sum(math.exp(v) for v in row))

    mean_ok = sum_ok = 0
    for label, ctx, ends in examples:
        sums = []
        for e in ends:
            seq = ctx + e
            sums.append(sum(logp(seq[len(ctx) + j - 1], seq[len(ctx) + j]) for j in range(len(e))))
        means = [s / len(e) for s, e in zip(sums, ends)]
        mean_ok += means.index(max(means)) == label
        sum_ok += sums.index(max(sums)) == label
    return mean_ok, sum_ok


def as_tuples(exs):
    return [(ex.label, ex.context, ex.endings) for ex in exs]


def test_reads_llmc_layout_and_writes_it_byte_for_byte(tmp_path):
    examples = random_examples(9, 50000, seed=1)
    (tmp_path / "llmc.bin").write_bytes(llmc_file(examples))
    got = read_evalfile(tmp_path / "llmc.bin")
    assert as_tuples(got) == examples and [ex.index for ex in got] == list(range(9))
    write_evalfile(tmp_path / "ours.bin", got)
    assert (tmp_path / "ours.bin").read_bytes() == llmc_file(examples)


def test_prepare_eval_matches_the_fixture(tmp_path):
    """The shipped fixture is prepare-eval's output, and reads back as the .jsonl's lines
    tokenized by hand (bytes: the context, then " " + each ending)."""
    assert cli.main(["data", "prepare-eval", "--jsonl", str(JSONL), "--out", str(tmp_path / "e.bin"),
                     "--tokenizer", "bytes"]) == 0
    assert (tmp_path / "e.bin").read_bytes() == FIXTURE.read_bytes()
    rows = [json.loads(line) for line in JSONL.read_text().splitlines()]
    want = [(r["label"], list(r["context"].encode()), [list((" " + e).encode()) for e in r["endings"]]) for r in rows]
    assert as_tuples(read_evalfile(FIXTURE)) == want


def test_accuracy_against_hand_computation():
    """A bigram stub (logits = table[previous token]), contexts longer than the model's context
    (cropped on the left: a bigram's scores do not change), 2-4 completions per example."""
    examples = random_examples(23, 7, seed=2)
    table = torch.randn(7, 7, generator=torch.Generator().manual_seed(5)) * 2
    mean_ok, sum_ok = by_hand(table.tolist(), examples)
    assert mean_ok != sum_ok  # the two scores are told apart
    exs = [Example(i, *ex) for i, ex in enumerate(examples)]
    res = totals(score(lambda x: table[x], exs, block_size=8, vocab=7), len(exs))
    assert (res["eval_correct"], res["eval_correct_sum"]) == (mean_ok, sum_ok)
    assert res["eval_acc"] == mean_ok / 23 and res["eval_acc_sum"] == sum_ok / 23
    with pytest.raises(UserError, match="vocabulary of 6"):
        score(lambda x: table[x], exs, block_size=8, vocab=6)


def test_counts_identical_over_1_2_4_ranks(tmp_path):
    """One 4-rank launch: 7 examples (not divisible by 2 or 4) dealt to 1, 2 and 4 ranks; the
    bigram's totals are also the hand computation's."""
    examples = random_examples(7, 256, seed=3)
    (tmp_path / "e.bin").write_bytes(llmc_file(examples))
    p = launch(ROOT / "tests" / "eval_worker.py", tmp_path / "e.bin", tmp_path, nproc=4)
    assert p.returncode == 0, p.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r == ranks[0] for r in ranks)
    res = ranks[0]
    for name in ("gpt", "moe", "bigram"):
        assert res[f"{name}/1"] == res[f"{name}/2"] == res[f"{name}/4"], res
    table = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)).tolist()  # the worker's
    assert (res["bigram/1"]["eval_correct"], res["bigram/1"]["eval_correct_sum"]) == by_hand(table, examples)


def one_line_error(capsys, argv, *words):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("braidtrain: error:") and "\n" not in err and "Traceback" not in err, err
    for w in words:
        assert w in err, err


def test_train_and_eval_end_to_end(shakespeare, tmp_path, capsys):
    """2 ranks under ZeRO-3 (gathered parameters, examples split over dp) with --eval-data:
    eval_acc in metrics.jsonl and summary.json; `braidtrain eval` on the finished run agrees."""
    run = tmp_path / "run"
    braidtrain("train", *SMALL, "-i", shakespeare, "-x", "4", "--lr", "0.01", "--warmup-steps", "0", "--zero", "3",
               "--eval-data", FIXTURE, "--eval-every", "2", "-h", "1", "--out", run, nproc=2)
    rows = [r for r in metrics(run) if "eval_acc" in r]
    assert [r["step"] for r in rows] == [2, 4] and rows[-1]["eval_n"] == 7
    s = summary(run)
    keys = ("eval_acc", "eval_acc_sum", "eval_correct", "eval_correct_sum", "eval_n")
    assert {k: s[k] for k in keys} == {k: rows[-1][k] for k in keys}
    assert s["eval_correct"] > 0 and s["eval_correct_sum"] > 0  # (lr 0.01: some right, so a count twice would show)
    capsys.readouterr()
    # (in-process: no torch import)
    assert cli.main(["eval", str(run), "--eval-data", str(FIXTURE), "--no-progress"]) == 0
    ev = json.loads((run / "eval.json").read_text())
    assert {k: ev[k] for k in keys} == {k: s[k] for k in keys} and ev["step"] == 4
    assert f"eval_acc {s['eval_acc']:.4f}" in capsys.readouterr().out
    # bad input: one line, exit 2
    bad = tmp_path / "bad.bin"
    bad.write_bytes(FIXTURE.read_bytes()[:-2])
    one_line_error(capsys, ["eval", str(run), "--eval-data", str(bad)], "truncated")
    bad.write_bytes(b"\0" * 1024)
    one_line_error(capsys, ["eval", str(run), "--eval-data", str(bad)], "magic 0", "20240522")
    token_file = next(Path(shakespeare).glob("*val*.bin"))
    one_line_error(capsys, ["eval", str(run), "--eval-data", str(token_file)], "token file")
    one_line_error(capsys, ["eval", str(run), "--eval-data", str(tmp_path / "missing.bin")], "missing.bin")
    one_line_error(capsys, ["train", *map(str, SMALL), "-i", str(shakespeare), "--out", str(tmp_path / "r2"),
                            "--eval-data", str(tmp_path / "missing.bin")], "missing.bin")
    assert not (tmp_path / "r2").exists()


def test_bad_eval_files_and_lines(tmp_path, capsys):
    examples = random_examples(3, 100, seed=4)
    raw = bytearray(llmc_file(examples))
    raw[1024 + 6:1024 + 8] = struct.pack("<H", 9)  # example 0's label: 9 of its 2-4 completions
    (tmp_path / "label.bin").write_bytes(raw)
    with pytest.raises(UserError, match="example 0.*label 9"):
        read_evalfile(tmp_path / "label.bin")
    (tmp_path / "extra.bin").write_bytes(llmc_file(examples) + b"\xff\xff")
    with pytest.raises(UserError, match="2 bytes after the 3 examples"):
        read_evalfile(tmp_path / "extra.bin")
    lines = tmp_path / "bad.jsonl"
    for text, words in [('{"context": "a", "endings": ["b"], "label": 0}\n{"context": "a", '
                         '"ending": []}', [":2:", '"endings"']),
                        ('\n\nnot json', [":3:", "JSON"]),
                        ('{"context": "a", "endings": ["b", "c"], "label": 2}', [":1:", "label 2"])]:
        lines.write_text(text)
        one_line_error(capsys, ["data", "prepare-eval", "--jsonl", str(lines), "--out", str(tmp_path / "o.bin"),
                                "--tokenizer", "bytes"], *words)
