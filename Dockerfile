# The trainer with CUDA JAX, for NVIDIA GPU machines and clusters.
#
#   docker build -t longctx .
#   docker run --gpus all --ipc=host -v "$PWD/runs:/app/runs" -v "$PWD/.data:/app/.data" \
#     longctx --config configs/1b_32k_striped.py --workdir runs/1b_32k_striped
#
# No CUDA base image is needed: `jax[cuda13]` installs NVIDIA's CUDA, cuDNN and NCCL as pip
# wheels, so the host needs only an NVIDIA driver that supports CUDA 13 (580 or newer) and
# the NVIDIA Container Toolkit (`--gpus`). `--ipc=host` gives NCCL enough shared memory
# between GPUs. Python 3.12 and JAX 0.11.2 with CUDA 13: what the tests and our GPU machines
# run.
FROM python:3.12-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    # XLA preallocates 75% of each GPU by default; long-context steps want nearly all of it.
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95

WORKDIR /app

# Dependencies first, from pyproject.toml and the pinned constraints only, so that editing
# the code does not re-download the CUDA wheels. The cuda13 extra of the pinned jax 0.11.2
# pulls the matching jax-cuda13-plugin/pjrt 0.11.2.
COPY pyproject.toml constraints.txt README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -c constraints.txt -r /tmp/requirements.txt "jax[cuda13]==0.11.2"

# Only the packages and scripts (not .venv, runs/ or cached data from the build context).
COPY configs configs
COPY data data
COPY model model
COPY parallelism parallelism
COPY trainer trainer
COPY scripts scripts
RUN pip install -c constraints.txt --no-deps -e .

ENTRYPOINT ["python", "-m", "trainer"]
