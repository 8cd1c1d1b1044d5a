# Two environments, because the frameworks want different Pythons:
#   .venv-oneflow  Python 3.10 + OneFlow 0.9.0 (CPU-capable with the cuDNN/cuBLAS wheels)
#   .venv-torch    Python 3.11 + torch (CPU build)
# `make test` and `make demo` create them on first use.

# (looked up when a venv is built: `make test-gpu` needs neither)
PY310 = $(shell tools/find-python 3.10)
PY311 = $(shell tools/find-python 3.11)
OF := .venv-oneflow
TO := .venv-torch
FLOOR := .venv-floor
DOCS := .venv-docs
VISION := .venv-vision
DEEPSPEED := 0.19.8
MEGATRON := 0.19.2
PYTEST_FLAGS ?= -p no:cacheprovider
# What the floor venv and tools/check-dist run: the plugin end to end (collection, wrappers, a real
# launch, the baseline lifecycle) and the pure core, without OneFlow or torch.
SMOKE := tests/test_install.py tests/unit/judging/test_gate_edges.py tests/unit/config/test_settings.py \
	tests/unit/config/test_cli_settings.py tests/unit/config/test_spec.py tests/unit/judging/test_verdict.py \
	tests/test_plugin.py::test_marked_tests_skip_without_the_option \
	tests/test_plugin.py::test_rank_switches_reach_the_ranks_resolved_and_a_marker_env_wins \
	tests/test_baseline_lifecycle.py::test_lifecycle

.PHONY: test test-long test-gpu gpu-wheels test-slurm lint docs reference docs-shots test-floor mutate dist-check demo demo-torch demo-oneflow baselines bench predict-validation venvs clean

venvs: $(OF)/.ready $(TO)/.ready $(TO)/frameworks/.ready

$(OF)/.ready: pyproject.toml
	test -n "$(PY310)"
	$(PY310) -m venv $(OF)
	$(OF)/bin/python -m pip install -q --upgrade pip
	$(OF)/bin/python -m pip install -q -e ".[oneflow,xdist]"
	touch $@

# What `make demo` needs: torch's CPU build and the plugin. The test frameworks are `make test`'s ($(TO)/frameworks).
$(TO)/.ready: pyproject.toml
	test -n "$(PY311)"
	$(PY311) -m venv $(TO)
	$(TO)/bin/python -m pip install -q --upgrade pip
	# Pinned first: the CPU build on the index; a bare `torch` would pull a multi-GB CUDA build.
	$(TO)/bin/python -m pip install -q "torch==2.13.0"
	$(TO)/bin/python -m pip install -q -e ".[torch,xdist,plots,dev]"
	touch $@

$(TO)/frameworks/.ready: $(TO)/.ready tests/frameworks.txt tests/frameworks-deepspeed.txt tests/frameworks-nodeps.txt
	rm -rf $(TO)/frameworks
	# The frameworks of tests/jobs.py (FOREIGN, TORCH_ZERO, TORCH_ACCELERATE), apart from the venv: their
	# pytest plugins (anyio's) would load in every rank of every other test (+0.3 s a start); the tests
	# that run them put .venv-torch/frameworks on the path.
	$(TO)/bin/python -m pip install -q --target $(TO)/frameworks -r tests/frameworks.txt -r tests/frameworks-deepspeed.txt
	$(TO)/bin/python -m pip install -q --no-deps --target $(TO)/frameworks -r tests/frameworks-nodeps.txt
	# DeepSpeed is a source archive whose build imports torch: built against this venv's torch (an
	# isolated build would fetch a CUDA one), installed without dependencies (frameworks-deepspeed.txt).
	DS_BUILD_OPS=0 $(TO)/bin/python -m pip wheel -q --no-deps --no-build-isolation -w $(TO)/wheels "deepspeed==$(DEEPSPEED)"
	$(TO)/bin/python -m pip install -q --no-deps --target $(TO)/frameworks $(TO)/wheels/deepspeed-$(DEEPSPEED)-*.whl
	touch $@

# torchvision's and timm's models (the fake GPU's sweep, benchmarks/fake_gpu_sweep.py, and its sample in
# make test): torchvision needs the torch it was built with, which is a CUDA build; the fake GPU runs it
# on a machine without a driver as it runs the CPU build.
$(VISION)/.ready: pyproject.toml tests/frameworks-vision.txt
	test -n "$(PY311)"
	rm -rf $(VISION)
	$(PY311) -m venv $(VISION)
	$(VISION)/bin/python -m pip install -q --upgrade pip
	$(VISION)/bin/python -m pip install -q -r tests/frameworks-vision.txt
	$(VISION)/bin/python -m pip install -q -e .
	touch $@

# The oldest versions pyproject.toml admits (tools/floor-requirements.txt), on the oldest Python.
$(FLOOR)/.ready: pyproject.toml tools/floor-requirements.txt
	test -n "$(PY310)"
	rm -rf $(FLOOR)
	$(PY310) -m venv $(FLOOR)
	$(FLOOR)/bin/python -m pip install -q -r tools/floor-requirements.txt
	$(FLOOR)/bin/python -m pip install -q --no-deps -e .
	$(FLOOR)/bin/python -m pip check
	touch $@

# The plugin's own tests: lint and types first, then the docs site, everything in the torch venv, the
# OneFlow-marked ones in the OneFlow venv, then the smoke tests at the dependency floors.
test: venvs lint docs $(VISION)/.ready
	$(TO)/bin/python -m pytest $(PYTEST_FLAGS) -n 2 -m "not long" tests
	$(OF)/bin/python -m pytest $(PYTEST_FLAGS) -n 2 -m "oneflow and not long" tests
	$(VISION)/bin/python -m pytest $(PYTEST_FLAGS) -m "vision and not long" tests/test_fake_gpu_sweep.py tests/test_fake_gpu_cuda_build.py
	$(MAKE) test-floor

# The wide validations a cheaper test in `make test` also covers (marked long): foreign models on the
# fake GPU, fresh installs, predictions at 8, torchrun's twin of the direct tests. Not in CI's budget.
test-long: venvs
	$(TO)/bin/python -m pytest $(PYTEST_FLAGS) -n 2 -m long tests
	$(OF)/bin/python -m pytest $(PYTEST_FLAGS) -n 2 -m "oneflow and long" tests

# ruff (with the rule that only plugin.py imports pytest) over every Python file of the repository
# (tools/ holds shell scripts, and the docs site's hooks), and mypy on the package, configured in pyproject.toml.
lint: $(TO)/.ready
	$(TO)/bin/python -m ruff check pytest_gpumem tests benchmarks examples conftest.py tools/docs
	$(TO)/bin/python -m mypy

# The docs site (mkdocs.yml): docs/ with README.md as its home page, the reference tables written from
# the code; --strict turns every warning (a broken link, anchor or nav entry) into a failure.
$(DOCS)/.ready: tools/docs/requirements.txt
	test -n "$(PY311)"
	rm -rf $(DOCS)
	$(PY311) -m venv $(DOCS)
	$(DOCS)/bin/python -m pip install -q -r tools/docs/requirements.txt
	touch $@

docs: $(DOCS)/.ready
	$(DOCS)/bin/python -m mkdocs build --strict --clean

# Screenshots of the built site opened from disk at 1280 px, and what they show wrong (a name cut
# mid-word, a block that scrolls sideways, search that needs a server): benchmarks/results/site/. Needs Debian's
# chromium (apt) and Playwright, kept in a venv of their own.
SHOTS := .venv-shots
docs-shots: docs
	test -x /usr/bin/chromium || (apt-get install -y -q chromium)
	test -x $(SHOTS)/bin/python || ($(PY311) -m venv $(SHOTS) && $(SHOTS)/bin/python -m pip install -q playwright==1.57.0)
	$(SHOTS)/bin/python tools/docs/screenshots.py --allow-wide-output "gpumem: peak memory per rank" \
		--allow-wide-output "xfailed examples/"

# Rewrite docs/reference.md's committed tables from the code (tests/test_readme.py checks they are current).
reference: $(TO)/.ready
	$(TO)/bin/python tools/docs/hooks.py

test-floor: $(FLOOR)/.ready
	$(FLOOR)/bin/python -m pytest $(PYTEST_FLAGS) $(SMOKE)

# Mutation testing of the gate ([tool.mutmut] in pyproject.toml): lists the surviving mutants.
mutate: $(TO)/.ready
	rm -rf mutants
	$(TO)/bin/python -m mutmut run --max-children 2 || true
	$(TO)/bin/python -m mutmut results

# Build the sdist and wheel (no warnings, no tests in the sdist) and run the smoke tests against the
# installed wheel on each Python version found (PYVERS="3.10 3.11 3.13").
PYVERS ?= 3.10 3.11 3.13
dist-check: $(TO)/.ready
	PYTHON=$(TO)/bin/python SMOKE="$(SMOKE)" tools/check-dist $(PYVERS)

# The GPU tier (tests marked gpu: CUDA + NCCL launches, NVML read by the ranks themselves), on a
# machine with NVIDIA GPUs; no test may skip there. GPU_PYTHON: an interpreter with torch built for CUDA
# and the plugin importable (results: benchmarks/results/test_gpu.txt, with the command used).
GPU_PYTHON ?= $(TO)/bin/python
# What the GPU machine's Python (3.12, torch with CUDA) lacks, as wheels in .whl/ for the device to
# carry: memray (kept in the repository), DeepSpeed (built here) and its dependencies.
gpu-wheels: $(TO)/frameworks/.ready
	$(TO)/bin/python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		-d .whl -r tests/frameworks-deepspeed.txt
	cp $(TO)/wheels/deepspeed-$(DEEPSPEED)-*.whl .whl/
	# Megatron-Core (tests/test_gpu.py -k megatron): its wheel is built per Python; it needs torch, numpy, packaging.
	$(TO)/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 -d .whl megatron-core==$(MEGATRON)
	# torchtitan and what its import needs beyond the machine's image (tests/frameworks-gpu.txt).
	$(TO)/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl -r tests/frameworks-gpu.txt

test-gpu:
	GPUMEM_FORBID_SKIPS=1 $(GPU_PYTHON) -m pytest $(PYTEST_FLAGS) -m gpu -v -rsP tests/test_gpu.py tests/test_gpu_reruns.py

# launcher=srun through a real Slurm: installs Debian's slurm and munge (apt, root), brings up a
# local cluster of two emulated nodes, runs tests/test_slurm.py inside an allocation of both (none
# may be skipped), and brings the cluster down, also when a test fails. docs/cluster.md.
test-slurm: venvs
	PYTEST_FLAGS="$(PYTEST_FLAGS)" TO=$(TO) OF=$(OF) tools/slurm/test

# The main job: pytest --gpumem over the real examples, printing the memory table.
# Both halves always run; the target fails when either had a real failure.
demo:
	@status=0; \
	$(MAKE) --no-print-directory demo-oneflow || status=1; \
	$(MAKE) --no-print-directory demo-torch || status=1; \
	exit $$status

demo-oneflow: $(OF)/.ready
	$(OF)/bin/python -m pytest $(PYTEST_FLAGS) --gpumem -rxX examples/test_oneflow_eager_dp.py examples/test_oneflow_graph_dp.py

demo-torch: $(TO)/.ready
	$(TO)/bin/python -m pytest $(PYTEST_FLAGS) --gpumem -rxX examples/test_torch_ddp.py examples/test_script_mode.py \
		examples/test_torch_cuda_fake.py

# CPU benchmarks, side by side with the raw tools: prints a table, writes benchmarks/results/cpu_bench.txt.
# (The GPU half runs on a GPU machine: benchmarks/gpu_evidence.py, results in docs/gpu.md.)
bench: venvs
	$(OF)/bin/python benchmarks/bench.py
	$(TO)/bin/python benchmarks/bench.py
	$(TO)/bin/python benchmarks/startup.py
	$(OF)/bin/python benchmarks/figures.py
	$(TO)/bin/python benchmarks/figures.py

# Predicted vs measured peaks at 8 ranks (heavy: 8-rank CPU launches): benchmarks/results/predict_validation.txt
predict-validation: venvs
	$(OF)/bin/python benchmarks/predict_validation.py
	$(TO)/bin/python benchmarks/predict_validation.py

# Rewrite the examples' stored baselines (review the diff, then commit baselines/).
baselines: venvs
	$(MAKE) demo PYTEST_FLAGS="$(PYTEST_FLAGS) --gpumem-refresh"

clean:
	rm -rf $(OF) $(TO) $(FLOOR) $(DOCS) $(SHOTS) site mutants
