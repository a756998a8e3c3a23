#!/usr/bin/env bash
# Makes VENV (default .venv) with a Python 3.12, the version the project pins (JAX 0.11.2, as
# our GPU machines run it, needs 3.12), and remakes one that another Python made. The
# Makefile then installs the pinned packages into it. PYTHON, when set, is the interpreter to
# use; otherwise the first Python 3.12 found: python3.12, python3, then pyenv's and uv's.
set -euo pipefail
VENV=${1:-.venv}
WANT=3.12

is_wanted() {  # Does "$1" run, and is it Python $WANT?
  [ -n "$1" ] && "$1" -c "import sys; sys.exit(sys.version_info[:2] != (${WANT/./, }))" 2>/dev/null
}

if is_wanted "$VENV/bin/python"; then
  exit 0
fi

candidates=()
if [ -n "${PYTHON:-}" ]; then
  candidates=("$PYTHON")
else
  candidates=(python$WANT python3)
  # pyenv's shims answer for a version only when it is selected, so ask for its folders too.
  for root in "${PYENV_ROOT:-}" "$HOME/.pyenv"; do
    [ -n "$root" ] && candidates+=("$root"/versions/$WANT*/bin/python$WANT)
  done
  command -v uv >/dev/null && candidates+=("$(uv python find $WANT 2>/dev/null || true)")
fi
python=
for candidate in "${candidates[@]}"; do
  if is_wanted "$candidate"; then python=$candidate; break; fi
done
if [ -z "$python" ]; then
  echo "error: Python $WANT is needed${PYTHON:+ (PYTHON=$PYTHON is not it)}; install it (e.g. \`uv python install $WANT\`, \`pyenv install $WANT\` or \`apt install python$WANT-venv\`) or name it with PYTHON=/path/to/python$WANT" >&2
  exit 1
fi
if [ -e "$VENV" ]; then
  echo "$VENV was made with $("$VENV/bin/python" --version 2>&1 || echo 'a Python that no longer runs'); remaking it with Python $WANT ($python)"
  rm -rf "$VENV"
fi
"$python" -m venv "$VENV"
