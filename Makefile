# The two quickstart commands. Each creates .venv and installs the pinned packages on first
# use (a stamp file makes later runs skip it), then does its job.
#   make train   # the embedded default: tiny model, synthetic data, 8 simulated CPU devices
#   make test    # the whole test suite
VENV := .venv
# The stamp names the Python: a .venv from another one is remade (scripts/venv.sh, which
# takes PYTHON=... or finds a Python 3.12).
STAMP := $(VENV)/.installed-py3.12
ARGS ?=

# uv installs the pinned packages into the venv (whose pip installs uv itself) and the folders
# beside it: it fetches, unpacks and compiles the bytecode in parallel. From empty download
# caches, `make test`'s whole set-up took 36 s on a 2-core machine, 82 s with pip. The
# bytecode is compiled at install, as pip did: every test's subprocess imports JAX.
UV_INSTALL = $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(VENV)/bin/python \
  -c constraints.txt

# XLA's GPU compiler for `--dry_run` (trainer/plan/plan_target.py): the CUDA 13 plugin our GPU
# machines run, pinned, in its own folder rather than the venv, where JAX would load it into
# every process (and, without CUDA, say so on every run). No GPU is needed. The tests plan
# for described H100s with it.
PLAN_GPU := .plan_gpu
PLAN_GPU_STAMP := $(PLAN_GPU)/.installed-cuda13

# XLA's TPU compiler for `--dry_run` on described TPU slices (trainer/plan/tpu_target.py):
# libtpu, pinned (the version jax[tpu] names), in its own folder: in the venv, JAX would try
# to start a TPU backend in every process. No TPU is needed; without it the TPU plan tests
# skip and say why.
PLAN_TPU := .plan_tpu
PLAN_TPU_STAMP := $(PLAN_TPU)/.installed

.PHONY: train test test_setup docs bench compare plan_gpu plan_tpu bench_plan gpu_check slurm_packages

# mimalloc for the tests (pinned, in its own folder, preloaded only by `make test`): the
# suite is mostly XLA compiling tiny programs, and glibc's malloc took about a sixth of that
# CPU; mimalloc cut the CPU of tests/test_windows.py by 8-9% (three runs side by side).
MIMALLOC_DIR := .mimalloc
MIMALLOC := $(MIMALLOC_DIR)/cmeel.prefix/lib/libmimalloc.so.3
# Preloaded only where it installed and loads (ld.so would otherwise print its error in every
# process, tests' subprocesses included); else the tests run on glibc's malloc.
PRELOAD = $$(LD_PRELOAD=$(abspath $(MIMALLOC)) env true 2>&1 | grep -q . || echo $(abspath $(MIMALLOC)))

train: $(STAMP)
	$(VENV)/bin/python -m trainer --config configs/tiny_cpu.py $(ARGS)

# Three workers on 2 cores: one more than the cores, for the time tests wait on subprocesses,
# Slurm's daemons and peers' timeouts. Sampled from /proc/stat every 2 s, the cores idle
# only in a run's last 10-15 s with three or with four (four ran no faster: 635-684 s,
# against 580-677 s with three, on one 2-core machine whose speed varied by up to 20% that day).
# Whole modules to a worker (a module-scoped fixture runs once), in the order
# tests/conftest.py sets: modules with slow tests first, the slowest first.
TEST_WORKERS ?= 3
# What the tests need, made in parallel (on a new machine: apt-get's Slurm beside uv's venv,
# then the three folders the venv's uv installs).
test_setup:
	@$(MAKE) --no-print-directory -j 4 $(STAMP) $(PLAN_GPU_STAMP) $(PLAN_TPU_STAMP) $(MIMALLOC) \
	  slurm_packages
test: test_setup
	LD_PRELOAD="$(PRELOAD)" $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(ARGS)

# The manual (docs/, mkdocs.yml) as a site in site/: MkDocs with Material, strict, so a broken
# link, a missing anchor or a page left out of the nav fails it (tests/test_docs.py builds it
# too). `make docs ARGS=serve` serves it at http://127.0.0.1:8000 while you edit.
# (NO_MKDOCS_2_WARNING: Material's notice of its end of life, which strict mode would not
# fail on, kept out of the build's output.)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs $(or $(ARGS),build)

# Striped vs ring with one process per core (scripts/compare_demo.py): the gain the tiny
# default cannot show.
compare: $(STAMP)
	$(VENV)/bin/python scripts/compare_demo.py $(ARGS)

plan_gpu: $(PLAN_GPU_STAMP)

plan_tpu: $(PLAN_TPU_STAMP)

# Every config under configs/ planned for described H100s at its own length (each stage of
# a staged one), one row each in results/bench_plan.jsonl with the commit and the JAX and
# plugin versions (scripts/bench_plan.py --all): run it when a change lands, so that a figure
# that moves, with the code or with the compiler, is recorded. Not part of `make test` (about
# 3 minutes of compiles on 2 cores).
bench_plan: $(STAMP) $(PLAN_GPU_STAMP)
	$(VENV)/bin/python scripts/bench_plan.py --all --plan_compiler=gpu $(ARGS)

# Debian's slurm-wlm and munge, for tests/test_slurm.py (a one-node Slurm cluster of its own),
# installed once where they are missing and apt-get runs as root. Never fails: without them
# the test skips and says why.
SLURM_PACKAGES := slurm-wlm munge
slurm_packages:
	@export PATH="$$PATH:/usr/sbin:/sbin" DEBIAN_FRONTEND=noninteractive; \
	if ! { command -v munged && command -v slurmctld && command -v slurmd && \
	       command -v sbatch; } >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing $(SLURM_PACKAGES) for tests/test_slurm.py"; \
	    { apt-get install -y -qq $(SLURM_PACKAGES) || { apt-get update -qq && \
	      apt-get install -y -qq $(SLURM_PACKAGES); }; } >/dev/null 2>&1 || \
	      echo "could not install $(SLURM_PACKAGES): tests/test_slurm.py will skip"; \
	  fi; \
	fi

# Every GPU figure in one call (scripts/gpu_check.py): on a GPU machine with the image's
# Python and the wheels of scripts/gpu_wheels.sh in .gpu_wheels/; SMOKE=1 runs the same
# script here on the CPU at tiny shapes (tests/test_gpu_check.py runs it too).
ifeq ($(SMOKE),1)
gpu_check: $(STAMP)
	JAX_PLATFORMS=cpu $(VENV)/bin/python scripts/gpu_check.py --smoke $(ARGS)
else
gpu_check:
	scripts/gpu_check.sh $(ARGS)
endif

$(PLAN_GPU_STAMP): constraints.txt $(STAMP)
	rm -rf $(PLAN_GPU)
	$(UV_INSTALL) --no-deps \
	  --target $(PLAN_GPU) jax-cuda13-plugin jax-cuda13-pjrt
	touch $(PLAN_GPU_STAMP)

$(PLAN_TPU_STAMP): constraints.txt $(STAMP)
	rm -rf $(PLAN_TPU)
	$(UV_INSTALL) --no-deps \
	  --target $(PLAN_TPU) libtpu && touch $(PLAN_TPU_STAMP) || \
	  echo "could not install libtpu: the TPU plan tests will skip"

$(MIMALLOC): constraints.txt $(STAMP)
	rm -rf $(MIMALLOC_DIR)
	$(UV_INSTALL) --no-deps \
	  --target $(MIMALLOC_DIR) cmeel-mimalloc && touch $(MIMALLOC) || \
	  echo "could not install mimalloc: the tests run on glibc's malloc (slower)"

$(STAMP): pyproject.toml constraints.txt
	@scripts/venv.sh $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -c constraints.txt uv
	$(UV_INSTALL) -e '.[test,docs]'
	touch $(STAMP)
