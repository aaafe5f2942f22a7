# loadtest/pd_goodput.py on the lent nvidia-h200-x2 (vLLM 0.26, torch 2.11, Python 3.12, no network).
# Calls before this one (each within 30 s of the last) copy into the machine:
#   /tmp/vparts: the three parts of ../shared/gpu/build-vllm-wheelhouse.sh (.vchunks/part00..02)
#   /tmp/xw: wheels for Python 3.12 that the image lacks: nixl==1.5.1 + nixl-cu13==1.5.1 (vLLM's
#     NixlConnector), rich + markdown-it-py + mdurl (the load generator's tables)
# Then, from the repository root: bash docs/gpu/h200/run_pd_goodput.sh [pd_goodput args]
# The model is an 8B Llama's shape without weights (engines keep vLLM's dummy weights), written
# in a process of its own before any engine starts.
set -eo pipefail
source "$(dirname "$0")/nixl_8b_env.sh"
python3 -m loadtest.pd_goodput --model /tmp/m8b --out "${OUT:-/tmp}/pd_goodput" "$@"
