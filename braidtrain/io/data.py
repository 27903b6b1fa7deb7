"""Tokenizers (gpt2, bytes, llama3), llm.c token shards, and the distributed loader
(corpus.py turns a corpus into shards).

Shards use llm.c's .bin layouts so data moves freely between llm.c and us:

    gpt-2:   [ 256 x int32 header: 20240520, 1, n_tokens, 0 ... ][ n_tokens x uint16 ]
    llama-3: [ 256 x int32 header: 20240801, 7, n_tokens, 0 ... ][ n_tokens x uint32 ]

Both are read everywhere; write_bin picks llama-3 only for a vocabulary whose ids exceed 65,535.

The loader implements the data-order contract (docs/architecture.md, "Data order"):
which tokens global sequence j of step s holds depends only on (seed, s, j), never
on world size, micro-batch size or whether the run was resumed.
"""
from __future__ import annotations

import base64
import glob
import importlib.util
import json
import os
import re
from functools import cache
from pathlib import Path

import numpy as np
import torch

from braidtrain.errors import UserError

HEADER_INTS = 256
MAGIC = 20240520  # the gpt-2 layout: uint16 tokens
VERSION = 1
LLAMA3_MAGIC = 20240801  # the llama-3 layout: uint32 tokens
LLAMA3_VERSION = 7
# magic -> (layout name, version, token dtype)
LAYOUTS = {MAGIC: ("gpt-2", VERSION, np.dtype("<u2")), LLAMA3_MAGIC: ("llama-3", LLAMA3_VERSION, np.dtype("<u4"))}
_HEADER_BYTES = HEADER_INTS * 4

# tiktoken's own GPT-2 split pattern (tiktoken_ext.openai_public.r50k_pat_str),
# copied so that no network and no tiktoken_ext registry lookup is ever needed.
_GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
# Meta's llama-3 split pattern (llama_models/llama3/tokenizer.py, Tokenizer.pat_str), copied for the
# same reason. Unlike GPT-2's it has no possessive quantifiers: tiktoken's regex overflows its stack
# on a run of ~100k spaces, so llama3_pieces cuts long runs first, as Meta's class does.
_LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Its 256 special tokens, ids 128000-128255 in this order (Meta's Tokenizer.__init__): twelve named,
# the rest reserved.
_LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
                   "<|image|>"] + [f"<|reserved_special_token_{i}|>" for i in range(2, 246)]
TOKENIZERS = ("gpt2", "bytes", "llama3")
# llama-3: 128,000 BPE ranks and 256 special tokens. Documents are separated by <|begin_of_text|>
# (128000), as llm.c's llama-3 shards are (its fineweb.py puts one before each document): the
# tokenizer's `eot`, which also starts a sample with no prompt. llm.c's shards come without a
# tokenizer.json: they train on their ids (LLAMA3_IDS: a sample prints as ids) unless the run names
# --tokenizer llama3.
LLAMA3_IDS, LLAMA3_VOCAB, LLAMA3_BOS = "llama3-ids", 128256, 128000
VOCAB = {"gpt2": 50257, "bytes": 256, "llama3": LLAMA3_VOCAB, LLAMA3_IDS: LLAMA3_VOCAB}


# ----------------------------------------------------------------------------- tokenizers

class Tokenizer:
    """name, vocab_size, eot, encode(str) -> list[int], decode(list[int]) -> str."""

    def __init__(self, name, vocab_size, eot, encode, decode, encode_array):
        self.name, self.vocab_size, self.eot = name, vocab_size, eot
        self._encode, self._decode, self._encode_array = encode, decode, encode_array

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def decode(self, tokens) -> str:
        return self._decode([int(t) for t in tokens])

    def encode_array(self, text: str) -> np.ndarray:
        """encode() as a uint16 array (uint32 above 65,536 tokens); the bytes tokenizer skips a
        5M-element Python list."""
        return self._encode_array(text)


@cache
def _gpt2_encoding():
    import tiktoken
    spec = importlib.util.find_spec("whisper")
    asset = Path(spec.submodule_search_locations[0]) / "assets" / "gpt2.tiktoken" if spec else None
    if asset is None or not asset.is_file():
        raise UserError("the gpt2 tokenizer needs the BPE ranks shipped with whisper: "
                        "run `pip install --no-deps openai-whisper`")
    ranks = _read_ranks(asset)
    return tiktoken.Encoding(name="gpt2", pat_str=_GPT2_PAT, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


def _read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file: each line "<base64 token bytes> <rank>". Parsed here rather than with
    tiktoken.load so that nothing can try to fetch or cache from the network."""
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


@cache
def _llama3_encoding():
    import tiktoken
    spec = importlib.util.find_spec("llama_models")  # (found, not imported: it needs more than tiktoken)
    asset = Path(spec.submodule_search_locations[0]) / "llama3" / "tokenizer.model" if spec else None
    if asset is None or not asset.is_file():
        raise UserError("the llama3 tokenizer needs the BPE ranks shipped with llama-models: "
                        "run `pip install --no-deps llama-models`")
    ranks = _read_ranks(asset)
    if len(ranks) != LLAMA3_BOS:
        raise UserError(f"{asset} holds {len(ranks)} BPE ranks, not llama-3's {LLAMA3_BOS}: "
                        "reinstall it with `pip install --no-deps --force-reinstall llama-models`")
    special = {t: LLAMA3_BOS + i for i, t in enumerate(_LLAMA3_SPECIAL)}
    return tiktoken.Encoding(name="llama3", pat_str=_LLAMA3_PAT, mergeable_ranks=ranks,
                             special_tokens=special, explicit_n_vocab=LLAMA3_VOCAB)


_WINDOW, _RUN = 400_000, 25_000  # Meta's TIKTOKEN_MAX_ENCODE_CHARS and MAX_NO_WHITESPACES_CHARS
# A run of more than _RUN whitespace, or non-whitespace, characters; the look-behinds let a match
# start only where its run starts (no retry from inside a long run: linear time).
_LONG_RUN = re.compile(r"(?<!\s)\s{%d,}|(?<!\S)\S{%d,}" % (_RUN + 1, _RUN + 1))  # noqa: UP031 (a regex's braces)


def llama3_pieces(text: str):
    """The pieces Meta's Tokenizer.encode hands tiktoken one by one (so that its regex never meets
    a run too long for its stack): windows of 400,000 characters, and within each, every run of
    whitespace or non-whitespace cut each 25,000 characters from the run's start. The same cuts as
    Meta's per-character loop (str.isspace is re's \\s), found by a regex; most documents are one
    piece."""
    for lo in range(0, len(text), _WINDOW):
        window = text[lo: lo + _WINDOW]
        start = 0
        for m in _LONG_RUN.finditer(window):
            for cut in range(m.start() + _RUN, m.end(), _RUN):
                yield window[start:cut]
                start = cut
        yield window[start:]


def get_tokenizer(name: str) -> Tokenizer:
    if name == "gpt2":
        enc = _gpt2_encoding()
        # encode_ordinary: a literal "<|endoftext|>" in a user's text is text, not a
        # document boundary (tiktoken's encode() would raise on it instead).
        return Tokenizer("gpt2", 50257, 50256, enc.encode_ordinary, enc.decode,
                         # (no special tokens allowed: encode_ordinary's ids, as an array with no list between)
                         lambda s: enc.encode_to_numpy(s, disallowed_special=()).astype(np.uint16))
    if name == "bytes":
        # UTF-8 bytes; eot is byte 0 (NUL), which does not occur in text files. A NUL
        # that does occur would read as a document boundary, nothing worse.
        return Tokenizer("bytes", 256, 0, lambda s: list(s.encode("utf-8")),
                         lambda t: bytes(t).decode("utf-8", errors="replace"),
                         lambda s: np.frombuffer(s.encode("utf-8"), np.uint8).astype(np.uint16))
    if name == "llama3":
        enc = _llama3_encoding()

        def encode_array(s: str) -> np.ndarray:
            # disallowed_special=(): a special token's text in a user's document is text (as Meta's
            # encode with its defaults, and encode_ordinary)
            parts = [enc.encode_to_numpy(p, disallowed_special=()) for p in llama3_pieces(s)]
            return np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else np.zeros(0, np.uint32)

        return Tokenizer("llama3", LLAMA3_VOCAB, LLAMA3_BOS, lambda s: encode_array(s).tolist(), enc.decode,
                         encode_array)
    if name == LLAMA3_IDS:
        def no_text(_):
            raise UserError("these llama-3 shards came without a tokenizer.json, so no text can be encoded for "
                            "them: sample without --prompt (an eval file needs llama-3's tokenizer)")
        return Tokenizer(LLAMA3_IDS, LLAMA3_VOCAB, LLAMA3_BOS, no_text, lambda t: "".join(f"<{i}>" for i in t), no_text)
    raise UserError(f"unknown tokenizer {name!r}: choose one of {', '.join(TOKENIZERS)}")


# ----------------------------------------------------------------------------- .bin files

def write_bin(path, tokens: np.ndarray, vocab_size: int | None = None) -> None:
    """Write one llm.c shard atomically: a reader never sees a half-written file. The gpt-2 layout
    (uint16) unless the vocabulary (vocab_size, else the largest token + 1) has ids above 65,535,
    then the llama-3 layout (uint32)."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if vocab_size is None:  # uint16 input needs no pass over the tokens
        wide = tokens.dtype != np.uint16 and tokens.size > 0 and int(tokens.max()) > 65535
    else:
        wide = vocab_size > 65536
    magic = LLAMA3_MAGIC if wide else MAGIC
    name, version, dtype = LAYOUTS[magic]
    if tokens.dtype != dtype:
        limit = np.iinfo(dtype).max
        if tokens.size and (tokens.min() < 0 or tokens.max() > limit):
            raise UserError(f"{path}: tokens must fit in {dtype.name} (0..{limit}) for the {name} layout")
        tokens = tokens.astype(dtype)
    if tokens.size >= 2**31:
        raise UserError(f"{path}: {tokens.size} tokens do not fit the int32 header count")
    header = np.zeros(HEADER_INTS, np.int32)
    header[:3] = magic, version, tokens.size
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype, copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_bin(path) -> np.ndarray:
    """Memory-map a shard's tokens (uint16 or uint32, by its layout) after checking every header field."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(_HEADER_BYTES)
    except OSError as e:
        raise UserError(f"cannot read token file {path}: {e.strerror or e}") from None
    if size < _HEADER_BYTES:
        raise UserError(f"{path} is truncated: {size} bytes, shorter than the "
                        f"{_HEADER_BYTES}-byte llm.c header")
    header = np.frombuffer(raw, dtype="<i4")
    magic, version, count = (int(v) for v in header[:3])
    if magic not in LAYOUTS:
        known = " or ".join(f"{m} ({n}, {d.name})" for m, (n, _, d) in LAYOUTS.items())
        raise UserError(f"{path} is not a llm.c token file (magic {magic}, expected {known})")
    name, expected, dtype = LAYOUTS[magic]
    if version != expected:
        raise UserError(f"{path} has llm.c format version {version}, expected {expected} "
                        f"for the {name} layout (magic {magic}, {dtype.name} tokens)")
    width = dtype.itemsize
    if count < 0 or size != _HEADER_BYTES + width * count:
        raise UserError(f"{path}: header says {count} tokens but the file holds "
                        f"{(size - _HEADER_BYTES) / width:g} (truncated or corrupt)")
    if count == 0:
        return np.zeros(0, dtype)  # np.memmap refuses zero-length maps
    return np.memmap(path, dtype=dtype, mode="r", offset=_HEADER_BYTES, shape=(count,))


def resolve_files(spec: str, split: str) -> list[Path]:
    """A file, a folder (its *{split}*.bin, sorted) or a glob pattern (sorted)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    p = Path(spec)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.glob(f"*{split}*.bin") if f.is_file())
    else:
        files = sorted(Path(f) for f in glob.glob(str(spec), recursive=True) if Path(f).is_file())
    if not files:
        flag = "-i" if split == "train" else "-j"
        raise UserError(f"no {split} data at '{spec}': run `braidtrain data prepare --out {spec}` "
                        f"or pass {flag} FILE|DIR|GLOB")
    return files


def tokenizer_for(files: list[Path]) -> str | None:
    """The tokenizer named in tokenizer.json beside the first shard, or None."""
    if not files:
        return None
    meta = Path(files[0]).parent / "tokenizer.json"
    if not meta.is_file():
        return None
    try:
        return json.loads(meta.read_text())["tokenizer"]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{meta} is not valid tokenizer metadata ({e})") from None


def data_tokenizer(files: list[Path], name: str | None = None) -> tuple[str, int]:
    """(tokenizer name, vocabulary size) of token files: `name` if given, else the one named beside
    them, else (llm.c's files carry no tokenizer.json) gpt2, or llama-3's ids for the llama-3
    layout (LLAMA3_IDS)."""
    name = name or tokenizer_for(files) or (LLAMA3_IDS if files and read_bin(files[0]).dtype.itemsize == 4 else "gpt2")
    return name, VOCAB[name] if name in VOCAB else get_tokenizer(name).vocab_size


# ----------------------------------------------------------------------------- reading

class TokenData:
    """All shards of one split, memory-mapped and joined virtually.

        shard 0            shard 1        shard 2
        [0 ........ o1)    [o1 .... o2)   [o2 ...... n_tokens)
    a window may start in one shard and end in another; only it is copied.
    """

    def __init__(self, files: list[Path], vocab_size: int):
        if not files:
            raise UserError("no token files given")
        self.files = [Path(f) for f in files]
        self.vocab_size = vocab_size
        self.shards = [read_bin(f) for f in self.files]
        for f, shard in zip(self.files, self.shards):
            # One pass per shard: a token >= vocab_size would index past the
            # embedding table and crash (or silently corrupt) far from the cause.
            if shard.size and int(shard.max()) >= vocab_size:
                raise UserError(f"{f} holds token {int(shard.max())}, outside the vocabulary of "
                                f"{vocab_size}: was it prepared with another tokenizer?")
        # starts[i] = global index of shard i's first token; starts[-1] = n_tokens.
        self.starts = np.concatenate([[0], np.cumsum([s.size for s in self.shards])]).astype(np.int64)

    @property
    def n_tokens(self) -> int:
        return int(self.starts[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, crossing shard boundaries."""
        if start < 0 or length < 0 or start + length > self.n_tokens:
            raise IndexError(f"window [{start}, {start + length}) outside 0..{self.n_tokens}")
        out = np.empty(length, np.int64)
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < length:
            lo = start + done - int(self.starts[i])
            take = min(length - done, self.shards[i].size - lo)
            out[done: done + take] = self.shards[i][lo: lo + take]
            done += take
            i += 1
        return out


class Loader:
    """The data-order contract (docs/architecture.md, "Data order"): global sequence j
    (0 <= j < d/t) of step s is a pure function of (seed, s, j), so any layout /
    micro-batch size / resume sees the same data. A rank takes a contiguous block
    of sequences.

    The corpus is cut into n_chunks non-overlapping chunks of T+1 tokens (chunk k
    = tokens [kT, kT+T+1); neighbours share one token, the last target of one
    being the first input of the next). Global sequence g = s * seq_per_step + j
    is chunk permutation(seed, epoch)[g % n_chunks] with epoch = g // n_chunks, so
    every chunk is seen exactly once per epoch and a resume needs no saved state.
    """

    def __init__(self, data: TokenData, seq_len: int, seq_per_step: int, seed: int):
        if seq_len < 1 or seq_per_step < 1:
            raise UserError(f"seq_len ({seq_len}) and sequences per step ({seq_per_step}) "
                            "must be at least 1")
        self.data, self.T, self.seq_per_step, self.seed = data, seq_len, seq_per_step, seed
        self.n_chunks = (data.n_tokens - 1) // seq_len
        if self.n_chunks < 1:
            raise UserError(f"{data.n_tokens} tokens in {data.files[0]}"
                            f"{' and others' if len(data.files) > 1 else ''} are too few for one "
                            f"sequence of length {seq_len}: need at least {seq_len + 1}")
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            # Seeded by (seed, epoch) alone, so epoch e's order never depends on
            # which epochs this process happened to visit before.
            perm = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.n_chunks)
            if len(self._perms) >= 2:  # keep the current epoch and its neighbour only
                del self._perms[next(iter(self._perms))]
            self._perms[epoch] = perm
        return perm

    def _rows(self, chunks) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.T
        buf = np.stack([self.data.window(int(k) * T, T + 1) for k in chunks])
        buf = torch.from_numpy(buf)
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()

    def batch(self, step: int, first_seq: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y (count, T) int64: sequences first_seq .. first_seq+count-1 of `step`."""
        if step < 0 or first_seq < 0 or count < 1 or first_seq + count > self.seq_per_step:
            raise ValueError(f"sequences [{first_seq}, {first_seq + count}) of step {step} "
                             f"outside 0..{self.seq_per_step}")
        chunks = []
        for j in range(first_seq, first_seq + count):
            epoch, pos = divmod(step * self.seq_per_step + j, self.n_chunks)
            chunks.append(self._perm(epoch)[pos])
        return self._rows(chunks)

    def val_batch(self, first_seq: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain sequential chunks first_seq, first_seq+1, ... (mod n_chunks): no shuffle,
        so every evaluation of the same range sees the same tokens."""
        if first_seq < 0 or count < 1:
            raise ValueError(f"bad validation range first_seq={first_seq} count={count}")
        return self._rows((first_seq + i) % self.n_chunks for i in range(count))


def unigram_entropy(data: TokenData) -> float:
    """Entropy (nats) of the token frequencies: the loss of the best model that ignores
    context, i.e. the baseline a trained model must beat."""
    counts = np.zeros(data.vocab_size, np.int64)
    block = 1 << 24  # bincount casts to int64: do it in blocks, not a shard-sized copy
    for shard in data.shards:
        for lo in range(0, shard.size, block):
            counts += np.bincount(shard[lo: lo + block], minlength=data.vocab_size)
    p = counts[counts > 0] / max(1, counts.sum())
    return float(-(p * np.log(p)).sum())
