#!/usr/bin/env bash
# Wheels, at this repo's pins, for a GPU machine that cannot reach a package index and
# whose Python 3.12 already has JAX 0.11.2 with CUDA (our pin), tensorstore, sentencepiece
# and safetensors, but not what `python -m trainer` also needs: TFDS, grain, array_record,
# ml_collections and their small dependencies, protobuf (googleapis-common-protos at our
# pin needs protobuf >= 6.33.5), and flax, optax and orbax at the versions CI tests (pure
# Python: the image's own may differ).
#
#   scripts/gpu_wheels.sh            # on a machine with the index: fills .gpu_wheels/
#   # with .gpu_wheels/ beside the checkout on the GPU machine (the device tool: carry it):
#   make gpu_check                   # installs them into /tmp/gpu_check_site, then runs
#
# `--no-deps --target`: pip resolves nothing against the image's packages (whose versions
# we do not know), so an unknown pin there cannot stop the install; `import trainer.run.loop`
# then says whether the image's other packages suit our code.
# W&B is left out: the benchmarks run with wandb.mode=disabled, which never imports it.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=".venv/bin/python -m pip --disable-pip-version-check"
OUT=.gpu_wheels
PACKAGES="tensorflow-datasets array_record grain ml_collections dm-tree immutabledict
  simple-parsing tensorflow-metadata termcolor toml googleapis-common-protos docstring_parser
  importlib_resources portpicker protobuf flax optax orbax-checkpoint"
pins=()
for name in $PACKAGES; do
  pin=$(grep -iE "^${name//[-_]/[-_]}==" constraints.txt) || { echo "no pin for $name"; exit 1; }
  pins+=("$pin")
done
mkdir -p "$OUT"
# The image's Python is 3.12 on x86-64 Linux.
$PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$OUT" "${pins[@]}"
# promise publishes no wheel; it is pure Python, so one built here installs there.
$PIP wheel --quiet --no-deps -w "$OUT" "$(grep -iE '^promise==' constraints.txt)"
ls "$OUT"
du -sh "$OUT"
