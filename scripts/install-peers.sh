#!/usr/bin/env bash
# The peer routers `pilotfish bench realtime` compares against, in their own virtualenv (default
# ./.venv-peers, where the benchmark looks first): vllm-router and sglang-router from PyPI, at the
# versions the README's figures were taken with. Their pins never touch the project's .venv.
# Idempotent: when both are already at the wanted versions it only checks, in about a second.
#   scripts/install-peers.sh                 install or check ./.venv-peers
#   scripts/install-peers.sh /tmp/peer-venv  another place (then pass --vllm-router/--sglang-router)
#   VLLM_ROUTER_VERSION=... SGLANG_ROUTER_VERSION=... scripts/install-peers.sh
set -euo pipefail
venv=${1:-}
[[ -z $venv || $venv == /* ]] || venv=$PWD/$venv  # a relative path is the caller's, not the repo's
cd "$(dirname "$0")/.."
venv=${venv:-.venv-peers}
vllm_router=${VLLM_ROUTER_VERSION:-0.1.17}
sglang_router=${SGLANG_ROUTER_VERSION:-0.3.2}
python=${PYTHON:-python3}

[[ -x $venv/bin/python ]] || "$python" -m venv "$venv"

have() {  # have DIST VERSION: the distribution is installed at exactly that version
    "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null
}

wanted=()
have vllm-router "$vllm_router" || wanted+=("vllm-router==$vllm_router")
have sglang-router "$sglang_router" || wanted+=("sglang-router==$sglang_router")
if ((${#wanted[@]})); then
    echo "install-peers: pip install ${wanted[*]} into $venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${wanted[@]}"
fi

for exe in vllm-router sglang-router; do
    [[ -x $venv/bin/$exe ]] || { echo "install-peers: error: $venv/bin/$exe missing after install" >&2; exit 1; }
done
echo "install-peers: vllm-router $vllm_router and sglang-router $sglang_router in $venv/bin"
