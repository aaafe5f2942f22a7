# tests/e2e/test_pd_cuda.py on the lent H200 (vLLM 0.26, torch 2.11, Python 3.12, no network).
# Calls before this one (each within 30 s of the last) copy into the machine:
#   /tmp/vparts: the three parts of ../shared/gpu/build-vllm-wheelhouse.sh (.vchunks/part00..02)
#   /tmp/xw: wheels for Python 3.12 that the image lacks: lmcache==0.5.6, nixl==1.5.1 + nixl-cu13,
#     numba 0.65 + llvmlite, numpy<2.5 (numba refuses the image's 2.5), cryptography + cffi +
#     pycparser, aiofile, caio, nvtx, sortedcontainers, msgpack, pyzmq, xxhash, httpx and its
#     deps, pytest + pytest-asyncio + pytest-timeout, ninja
#   $LMCACHE_CSRC: csrc/ of the lmcache-0.5.6 sdist (for build_lmcache_cuda_ops.py)
# Then, from the repository root: LMCACHE_CSRC=... bash docs/gpu/h200/run_cuda_test.sh
set -eo pipefail
HERE=$(dirname "$0")
[ -d /tmp/site ] || bash /tmp/vparts/install.sh > /tmp/install.log 2>&1
source /tmp/vparts/env.sh
[ -d /tmp/xsite/lmcache ] || python3 -m pip install -q --no-index --no-deps --target /tmp/xsite /tmp/xw/*.whl
export PATH=/tmp/xsite/bin:$PATH PYTHONPATH=$PYTHONPATH:/tmp/xsite
[ -f /tmp/lmbuild/cuda_ops.so ] || python3 "$HERE/build_lmcache_cuda_ops.py" "$LMCACHE_CSRC" /tmp/xsite
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pytest tests/e2e/test_pd_cuda.py -v -p no:cacheprovider --timeout 420 "$@"
