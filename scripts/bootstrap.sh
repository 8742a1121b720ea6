#!/usr/bin/env bash
# Creates .venv/ in the project root (if absent) and installs feddomain into it (editable, with
# test tools). Re-running is cheap: the install is skipped while pyproject.toml is unchanged.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[feddomain] creating virtual environment in .venv/"
  "$python" -m venv .venv
fi
stamp=".venv/.feddomain-install-stamp"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[feddomain] installing feddomain and its dependencies into .venv/ (first time: a few minutes)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]'
  echo "$want" > "$stamp"
fi
