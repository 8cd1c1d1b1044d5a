# Two environments, because the frameworks want different Pythons:
#   .venv-oneflow  Python 3.10 + OneFlow 0.9.0 (CPU-capable with the cuDNN/cuBLAS wheels)
#   .venv-torch    Python 3.11 + torch (CPU build)
# `make test` and `make demo` create them on first use.

PY310 := $(shell tools/find-python 3.10)
PY311 := $(shell tools/find-python 3.11)
OF := .venv-oneflow
TO := .venv-torch
PYTEST_FLAGS ?= -p no:cacheprovider

.PHONY: test test-slurm demo demo-torch demo-oneflow baselines bench venvs clean

venvs: $(OF)/.ready $(TO)/.ready

$(OF)/.ready: pyproject.toml
	test -n "$(PY310)"
	$(PY310) -m venv $(OF)
	$(OF)/bin/python -m pip install -q --upgrade pip
	$(OF)/bin/python -m pip install -q -e ".[oneflow,xdist]"
	touch $@

$(TO)/.ready: pyproject.toml
	test -n "$(PY311)"
	$(PY311) -m venv $(TO)
	$(TO)/bin/python -m pip install -q --upgrade pip
	# Pinned first: the CPU build on the index; a bare `torch` would pull a multi-GB CUDA build.
	$(TO)/bin/python -m pip install -q "torch==2.13.0"
	$(TO)/bin/python -m pip install -q -e ".[torch,xdist,plots]"
	touch $@

# The plugin's own tests: everything in the torch venv, the OneFlow-marked ones in the OneFlow venv.
test: venvs
	$(TO)/bin/python -m pytest $(PYTEST_FLAGS) -n 2 tests
	$(OF)/bin/python -m pytest $(PYTEST_FLAGS) -n 2 -m oneflow tests

# launcher=srun through a real Slurm: installs Debian's slurm and munge (apt, root), brings up a
# local cluster of two emulated nodes, runs tests/test_slurm.py inside an allocation of both (none
# may be skipped), and brings the cluster down, also when a test fails. docs/cluster.md.
test-slurm: venvs
	PYTEST_FLAGS="$(PYTEST_FLAGS)" TO=$(TO) OF=$(OF) tools/slurm/test

# The main job: pytest --gpumem over the real examples, printing the memory table.
demo: demo-oneflow demo-torch

demo-oneflow: $(OF)/.ready
	$(OF)/bin/python -m pytest $(PYTEST_FLAGS) --gpumem -rxX examples/test_oneflow_eager_dp.py examples/test_oneflow_graph_dp.py

demo-torch: $(TO)/.ready
	$(TO)/bin/python -m pytest $(PYTEST_FLAGS) --gpumem -rxX examples/test_torch_ddp.py examples/test_script_mode.py

# CPU benchmarks, side by side with the raw tools: prints a table, writes benchmarks/results/cpu_bench.txt.
# (The GPU half runs on a GPU machine: benchmarks/gpu_evidence.py, results in docs/gpu.md.)
bench: venvs
	$(OF)/bin/python benchmarks/bench.py
	$(TO)/bin/python benchmarks/bench.py

# Rewrite the examples' stored baselines (review the diff, then commit baselines/).
baselines: venvs
	$(MAKE) demo PYTEST_FLAGS="$(PYTEST_FLAGS) --gpumem-refresh"

clean:
	rm -rf $(OF) $(TO)
