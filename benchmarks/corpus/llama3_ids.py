"""Shakespeare on Llama-3's 128,256-id vocabulary, offline, for the GPU benchmarks (no tokenizer.json
reaches the GPU machine): data/shakespeare_bytes (prepared from the corpus braidtrain ships, if it is
not there), its bytes two at a time -- 0 .. 65535, one id a pair -- spread over the 128,256 ids, into
data/shakespeare_128k (Llama-3's layout: uint32). Nothing is done where both already exist.

    python benchmarks/corpus/llama3_ids.py        (from the repo root)
"""

import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from braidtrain.io.data import LLAMA3_VOCAB, read_bin, write_bin  # noqa: E402

SRC, DST = Path("data/shakespeare_bytes"), Path("data/shakespeare_128k")


def main() -> None:
    if not (SRC / "shakespeare_val_000000.bin").exists():
        subprocess.run([sys.executable, "-m", "braidtrain", "data", "prepare", "--corpus", "shakespeare",
                        "--tokenizer", "bytes", "--out", str(SRC)], check=True, stdout=subprocess.DEVNULL)
    if (DST / "shakespeare_val_000000.bin").exists():
        return
    DST.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        b = np.concatenate([np.asarray(read_bin(f)) for f in sorted(SRC.glob(f"*_{split}_*.bin"))]).astype(np.int64)
        pairs = b[: len(b) // 2 * 2].reshape(-1, 2) @ np.array([256, 1])
        write_bin(DST / f"shakespeare_{split}_000000.bin", (pairs * (LLAMA3_VOCAB - 1) // 65535).astype(np.uint32),
                  LLAMA3_VOCAB)
        print(f"{DST}: {split} {len(pairs):,} tokens over {LLAMA3_VOCAB:,} ids")


if __name__ == "__main__":
    main()
