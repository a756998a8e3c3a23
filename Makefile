# The two quickstart commands. Each creates .venv and installs the pinned packages on first
# use (a stamp file makes later runs skip it), then does its job.
#   make train   # the embedded default: tiny model, synthetic data, 8 simulated CPU devices
#   make test    # the whole test suite
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
ARGS ?=

# XLA's GPU compiler for `--dry_run` (trainer/plan_target.py): the CUDA plugin, pinned, in its
# own folder rather than the venv, where JAX would load it into every process (and, without
# CUDA, say so on every run). No GPU is needed. The tests plan for described H100s with it.
PLAN_GPU := .plan_gpu
PLAN_GPU_STAMP := $(PLAN_GPU)/.installed

.PHONY: train test bench compare plan_gpu

train: $(STAMP)
	$(VENV)/bin/python -m trainer --config configs/tiny_cpu.py $(ARGS)

# Two workers: most tests wait on one single-threaded XLA compile, so two cores overlap two.
# Whole modules to a worker (a module-scoped fixture runs once), in the order
# tests/conftest.py sets: modules with slow tests first, the slowest first.
TEST_WORKERS ?= 2
test: $(STAMP) $(PLAN_GPU_STAMP)
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(ARGS)

# Striped vs ring with one process per core (scripts/compare_demo.py): the gain the tiny
# default cannot show.
compare: $(STAMP)
	$(VENV)/bin/python scripts/compare_demo.py $(ARGS)

plan_gpu: $(PLAN_GPU_STAMP)

$(PLAN_GPU_STAMP): constraints.txt $(STAMP)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps --upgrade \
	  --target $(PLAN_GPU) -c constraints.txt jax-cuda12-plugin jax-cuda12-pjrt
	touch $(PLAN_GPU_STAMP)

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is needed, found " + sys.version.split()[0]'
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)
