# tests/conformance/test_conformance_gpu.py on the lent H200 (vLLM 0.26, torch 2.11, Python 3.12,
# no network): a tied random ~1B Llama through our disk streaming loader and a CUDA IPC standby,
# against plain vLLM. Calls before this one (each within 30 s of the last) copy the three parts of
# ../shared/gpu/build-vllm-wheelhouse.sh (.vchunks/part00..02) into /tmp/vparts.
# Then, from the repository root: bash docs/gpu/h200/run_conformance.sh [pytest args]
# With two GPUs or more (nvidia-h200-x2) the TP=2 test runs too (disk and per-rank CUDA IPC).
set -eo pipefail
[ -d /tmp/site ] || bash /tmp/vparts/install.sh > /tmp/install.log 2>&1
source /tmp/vparts/env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pytest tests/conformance/test_conformance_gpu.py -v -s -p no:cacheprovider --timeout 560 "$@"
