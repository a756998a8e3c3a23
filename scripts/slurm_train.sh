#!/bin/bash
# Trains on N nodes under SLURM; by default one process per node driving its 8 GPUs:
#
#   sbatch --nodes=4 scripts/slurm_train.sh configs/7b_256k_striped.py /shared/runs/7b_256k_striped
#
# Extra arguments go to the trainer (e.g. --config.train.steps=2000). The config's mesh must
# multiply to the job's device count (set one axis to -1 to fill the rest); check it first with
#   python -m trainer --config CONFIG --dry_run.
# What is specific to GPUs comes from the allocation, so sbatch's own flags change it and the
# same script runs a CPU allocation (tests/test_slurm.py runs it on a one-node test cluster):
#   sbatch --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 scripts/slurm_train.sh \
#     configs/tiny_cpu.py runs/slurm --config.cpu_devices=4
# Every process runs the same command; trainer/run/distributed.py sees SLURM_NTASKS > 1 and calls
# jax.distributed.initialize(), which reads the coordinator (first node), process count and
# id from SLURM's environment. Each process feeds only its own rows; process 0 logs.
# Preemption and the time limit: SIGTERM to every task (scancel --signal=TERM JOB, or the
# --signal below); the processes agree on one step, save it and exit 0. `scontrol requeue JOB`
# or submitting again with the same workdir resumes from the newest checkpoint.
#
#SBATCH --job-name=longctx
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=slurm-%j.out
# A requeued job keeps its id: append, so the log of the run it resumes stays above.
#SBATCH --open-mode=append
# SIGTERM to the trainer 5 minutes before the time limit: it saves a checkpoint and stops.
#SBATCH --signal=TERM@300

set -euo pipefail
CONFIG=${1:?usage: sbatch [--nodes=N] scripts/slurm_train.sh CONFIG WORKDIR [trainer flags]}
WORKDIR=${2:?usage: sbatch [--nodes=N] scripts/slurm_train.sh CONFIG WORKDIR [trainer flags]}
shift 2

# The node's GPUs ("h100:8" or "8"; none on a CPU allocation), split evenly among its tasks.
GPUS_ON_NODE=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}
export GPUS_PER_TASK=$(( ${GPUS_ON_NODE##*:} / (SLURM_NTASKS / SLURM_JOB_NUM_NODES) ))
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}

# Under SLURM, JAX shows each process only GPU number SLURM_LOCALID (it assumes one task per
# GPU): a task that drives several must name its own, which only the task knows (its
# SLURM_LOCALID), hence the inner shell.
# The workdir (checkpoints, metrics.jsonl) must be on storage every node sees.
# In a container (e.g. the Dockerfile's image with pyxis), add --container-image=... to srun.
srun --kill-on-bad-exit=1 bash -c '
  if (( GPUS_PER_TASK > 0 )); then
    first=$(( SLURM_LOCALID * GPUS_PER_TASK ))
    export JAX_LOCAL_DEVICE_IDS=$(seq -s, "$first" $(( first + GPUS_PER_TASK - 1 )))
  fi
  exec python -m trainer "$@"' trainer --config "$CONFIG" --workdir "$WORKDIR" "$@"
