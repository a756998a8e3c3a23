#!/bin/bash
# Trains on N nodes x 8 GPUs under SLURM, one process per node:
#
#   sbatch --nodes=4 scripts/slurm_train.sh configs/7b_256k_striped.py /shared/runs/7b_256k_striped
#
# Extra arguments go to the trainer (e.g. --config.train.steps=2000). The config's mesh must
# multiply to nodes x 8 devices (set one axis to -1 to fill the rest); check it first with
#   python -m trainer --config CONFIG --dry_run.
# Every process runs the same command; trainer/run/distributed.py sees SLURM_NTASKS > 1 and calls
# jax.distributed.initialize(), which reads the coordinator (first node), process count and
# id from SLURM's environment. Each process feeds only its own rows; process 0 logs.
# Re-submitting with the same workdir resumes from its newest checkpoint.
#
#SBATCH --job-name=longctx
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%j.out
# SIGTERM to the trainer 5 minutes before the time limit: it saves a checkpoint and stops.
#SBATCH --signal=TERM@300

set -euo pipefail
CONFIG=${1:?usage: sbatch [--nodes=N] scripts/slurm_train.sh CONFIG WORKDIR [trainer flags]}
WORKDIR=${2:?usage: sbatch [--nodes=N] scripts/slurm_train.sh CONFIG WORKDIR [trainer flags]}
shift 2

# Under SLURM, JAX makes each process see only GPU number SLURM_LOCALID (it assumes one task
# per GPU). With one task per node, that would be GPU 0 alone: give each process all 8.
export JAX_LOCAL_DEVICE_IDS=0,1,2,3,4,5,6,7
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}

# The workdir (checkpoints, metrics.jsonl) must be on storage every node sees.
# In a container (e.g. the Dockerfile's image with pyxis), add --container-image=... to srun.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  python -m trainer --config "$CONFIG" --workdir "$WORKDIR" "$@"
