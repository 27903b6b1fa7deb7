"""scripts/: every launch script trains 2 ranks for one step on this machine -- mpirun.sh under the
real mpirun, the Slurm files through stand-in sbatch / srun / scontrol that start a job's tasks here
-- and each ends with the weights of the same job run in one process (--exact: bitwise across dp)."""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from helpers import ROOT, SMALL, env, hold_port

# Stand-ins for Slurm's tools: a job's "nodes" are all this machine. Only the first node's name
# resolves (127.0.0.1): a script that looked for rank 0 anywhere else would not find it.
STANDINS = {
    "sbatch": r"""#!/bin/bash
# stand-in sbatch [--nodes=N] [--ntasks-per-node=M] SCRIPT [ARGS]: runs the job now, in the foreground.
# --nodes / --ntasks-per-node: the script's #SBATCH lines, then these options (which win).
nodes=1 per=1 opts=()
while [[ $1 == -* ]]; do opts+=("$1"); shift; done
script=$1; shift
for a in $(sed -n 's/^#SBATCH *//p' "$script") "${opts[@]}"; do
  case $a in --nodes=*) nodes=${a#*=} ;; --ntasks-per-node=*) per=${a#*=} ;; esac
done
export SLURM_JOB_ID=$$ SLURM_NNODES=$nodes SLURM_JOB_NUM_NODES=$nodes SLURM_NTASKS=$((nodes * per))
export SLURM_NTASKS_PER_NODE=$per SLURM_JOB_NODELIST=127.0.0.1$(seq -s '' -f ',standin-node%g' 1 $((nodes - 1)))
exec bash "$script" "$@"
""",
    "srun": r"""#!/bin/bash
# stand-in srun CMD...: the job's SLURM_NTASKS tasks here, the last rank first (each rank > 0 then
# waits for rank 0); exits non-zero if any task does.
pids=()
for ((i = SLURM_NTASKS - 1; i >= 0; i--)); do
  SLURM_PROCID=$i SLURM_LOCALID=$((i % SLURM_NTASKS_PER_NODE)) SLURM_NODEID=$((i / SLURM_NTASKS_PER_NODE)) "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
""",
    "scontrol": r"""#!/bin/bash
# stand-in scontrol show hostnames [LIST]: one name a line
[[ "$1 $2" == "show hostnames" ]] || { echo "stand-in scontrol knows only 'show hostnames'" >&2; exit 1; }
tr , '\n' <<< "${3:-$SLURM_JOB_NODELIST}"
""",
}

# a hang fails in 60 s
TRAIN = list(map(str, [*SMALL, "-x", 1, "-d", 256, "--device", "cpu", "--exact", "--timeout", 60]))
SCRIPTS = ("torchrun.sbatch", "tcp.sbatch", "fs.sbatch", "mpirun.sh")


def mpi_missing():
    import importlib.util
    missing = [w for w, ok in (("mpirun", shutil.which("mpirun")), ("mpi4py", importlib.util.find_spec("mpi4py"))) if not ok]
    return f"needs {' and '.join(missing)} (`make test` installs both)" if missing else None


@pytest.fixture(scope="module")
def launched(tmp_path_factory, shakespeare):
    """Every script started at once (they wait on each other's CPU, not on each other): name -> (rc, output, run)."""
    tmp = tmp_path_factory.mktemp("scripts")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name, text in STANDINS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    base = {k: v for k, v in env().items() if not k.startswith(("SLURM_", "MASTER_", "WORLD_SIZE", "LOCAL_RANK"))}
    base.update(PATH=f"{bin_dir}{os.pathsep}{base['PATH']}", PYTHON=sys.executable, CONFIG="tiny",
                DATA=str(shakespeare))
    held = []  # each launch's port and the stale file's, held until the jobs are done (helpers.hold_port)

    def port():
        held.append(hold_port())
        return str(held[-1].getsockname()[1])

    # A stale rendezvous file in the fs script's folder, naming a dead port: rank 1 (started first)
    # may read it, and must wait for the one rank 0 writes instead.
    fs_dir = tmp / "shared"
    fs_dir.mkdir()
    (fs_dir / "braidtrain_rendezvous.txt").write_text(f"127.0.0.1:{port()} braidtrain/0123456789ab\n")
    script = lambda name: str(ROOT / "scripts" / name)
    two_nodes = ["sbatch", "--nodes=2", "--ntasks-per-node=1"]
    jobs = {  # name: (command, extra environment)
        "torchrun.sbatch": ([*two_nodes, script("torchrun.sbatch")], dict(NPROC="1")),
        "tcp.sbatch": ([*two_nodes, script("tcp.sbatch")], {}),
        "fs.sbatch": (["sbatch", "--nodes=1", "--ntasks-per-node=2", script("fs.sbatch")], dict(FS_DIR=str(fs_dir))),
        "mpirun.sh": ([script("mpirun.sh")], dict(NP="2", MPIRUN_ARGS="--allow-run-as-root --oversubscribe")),
        "one process": ([sys.executable, "-m", "braidtrain", "train", "--config", "tiny", "-i", str(shakespeare),
                         "--out", str(tmp / "run_one process")], {}),
    }
    if mpi_missing():
        del jobs["mpirun.sh"]
    procs, found = {}, {}
    try:
        for name, (cmd, extra) in jobs.items():
            e = dict(base, OUT=str(tmp / f"run_{name}"), PORT=port(), **extra)
            procs[name] = subprocess.Popen([*cmd, *TRAIN], cwd=tmp, env=e, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for name, p in procs.items():
            found[name] = (p.communicate(timeout=300)[0], tmp / f"run_{name}")
    finally:
        for p in procs.values():  # a launcher's own children (torchrun's, mpirun's ranks) too
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        for s in held:
            s.close()
    return {name: (procs[name].returncode, out, run) for name, (out, run) in found.items()} | {"fs_dir": fs_dir}


def trained(launched, name, world=2):
    """The run: exit 0, `world` ranks, one step; its summary."""
    if name == "mpirun.sh" and mpi_missing():
        pytest.skip(mpi_missing())
    rc, out, run = launched[name]
    assert rc == 0, out[-5000:]
    assert f"world {world} (gloo on cpu)" in out, out[-3000:]
    assert sorted(p.name for p in (run / ".ranks").iterdir()) == [str(r) for r in range(world)]  # all wrote into OUT
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 1
    return summary


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_trains_two_ranks(launched, name):
    mine = trained(launched, name)
    # the same job whatever launched it: the one-process run's weights, to the bit
    assert mine["weights_sha256"] == trained(launched, "one process", world=1)["weights_sha256"]
    if name == "fs.sbatch":
        assert not (launched["fs_dir"] / "braidtrain_rendezvous.txt").exists()  # rank 0 cleaned up
