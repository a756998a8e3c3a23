# The trainer with CUDA JAX, for NVIDIA GPU machines and clusters.
#
#   docker build -t longctx .
#   docker run --gpus all --ipc=host -v "$PWD/runs:/app/runs" -v "$PWD/.data:/app/.data" \
#     longctx --config configs/1b_32k_striped.py --workdir runs/1b_32k_striped
#
# No CUDA base image is needed: `jax[cuda12]` installs NVIDIA's CUDA, cuDNN and NCCL as pip
# wheels, so the host needs only an NVIDIA driver that supports CUDA 12 and the NVIDIA
# Container Toolkit (`--gpus`). `--ipc=host` gives NCCL enough shared memory between GPUs.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    # XLA preallocates 75% of each GPU by default; long-context steps want nearly all of it.
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95

WORKDIR /app

# Dependencies first, from pyproject.toml and the pinned constraints only, so that editing
# the code does not re-download the CUDA wheels. The cuda12 extra of the pinned jax 0.10.2
# pulls the matching jax-cuda12-plugin/pjrt 0.10.2.
COPY pyproject.toml constraints.txt README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -c constraints.txt -r /tmp/requirements.txt "jax[cuda12]==0.10.2"

# Only the packages and scripts (not .venv, runs/ or cached data from the build context).
COPY configs configs
COPY data data
COPY model model
COPY parallelism parallelism
COPY trainer trainer
COPY scripts scripts
RUN pip install -c constraints.txt --no-deps -e .

ENTRYPOINT ["python", "-m", "trainer"]
