# loadtest.engine_profile on the lent H200 (vLLM 0.26, torch 2.11, Python 3.12, no network): the
# step-time and KV hand-over profile the serving simulator runs on (issue #37).
# Calls before this one (each within 30 s of the last) copy into the machine:
#   /tmp/vparts: the parts of ../shared/gpu/build-vllm-wheelhouse.sh (.vchunks/part00..)
#   /tmp/xw: nixl==1.5.1 + nixl-cu13==1.5.1 for Python 3.12 (the store shard's NIXL agent)
# Then, from the repository root: bash docs/gpu/h200/run_profile.sh [engine_profile args]
# The model is an 8B Llama's shape without weights (the engine keeps vLLM's dummy weights; the
# shape of docs/pd.md's two-GPU run), written in a process of its own before the engine starts.
set -eo pipefail
source "$(dirname "$0")/nixl_8b_env.sh"
python3 -m loadtest.engine_profile --model /tmp/m8b --no-eager --out "${OUT:-/tmp}/engine_profile-h200-8b.json" "$@"
