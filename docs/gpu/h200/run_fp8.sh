# FP8 on the lent H200 (issue #35 item 3): tests/conformance/test_conformance_gpu.py with vLLM's
# online FP8 (`online`: --quantization=fp8 on the bf16 checkpoint) or an offline FP8 checkpoint
# (`offline`: engine/models.py llama1b-tied-fp8, compressed-tensors FP8_DYNAMIC), our engines and
# plain vLLM alike, prefix caching off on both sides (docs/conformance.md says why).
# Calls before this one copy the .vchunks parts into /tmp/vparts (as for run_conformance.sh); this
# one carries .gpuq/ (compressed-tensors 0.17.0 and loguru: vLLM 0.26's FP8 code imports them and
# the wheelhouse lacks them). From the repository root: bash docs/gpu/h200/run_fp8.sh online|offline
set -eo pipefail
[ -d /tmp/site ] || bash /tmp/vparts/install.sh > /tmp/install.log 2>&1
[ -d /tmp/qsite ] || python3 -m pip install -q --no-index --no-deps --target /tmp/qsite .gpuq/*.whl
source /tmp/vparts/env.sh
export PYTHONPATH=$PYTHONPATH:/tmp/qsite:$PWD PDC_CUDA_MODEL_DIR=/tmp/models
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
case "$1" in
  online) export PDC_CUDA_ENGINE_ARGS="--quantization=fp8 --no-enable-prefix-caching" ;;
  offline) export PDC_CUDA_MODEL=llama1b-tied-fp8 PDC_CUDA_ENGINE_ARGS="--no-enable-prefix-caching" ;;
  *) echo "usage: $0 online|offline [pytest args]" >&2; exit 2 ;;
esac
shift
mkdir -p /tmp/models
python3 -m pytest tests/conformance/test_conformance_gpu.py -k "not tp2" -v -s -p no:cacheprovider --timeout 560 "$@"
