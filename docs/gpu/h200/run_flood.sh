# The router under an idle flood on the GPU machine's 16 cores (issue #31: tenants' TTFT p99 within
# 2x of quiet while 20,000 idle stranger connections are held; on the 2-core CPU machine the flood's
# processes and the tenants share two cores). `pdcluster serve --model tiny` on the GPU (vLLM 0.26),
# measured by loadtest.router_overhead. Calls before this one (each within 30 s of the last) copy
# .vchunks/part00..03 into /tmp/vparts and .gpuray/part0..1 (docs/gpu/h200/rayhouse.sh) into
# /tmp/rayparts. Then, from the repository root: bash docs/gpu/h200/run_flood.sh
#   FLOOD (20000), ROUNDS (200), RUNS (3), DECOY=1: the same flood at a decoy router too
set -eo pipefail
[ -d /tmp/site ] || bash /tmp/vparts/install.sh > /tmp/install.log 2>&1
[ -f /tmp/xray/.installed ] || bash /tmp/rayparts/install-ray.sh > /tmp/install-ray.log 2>&1
source /tmp/vparts/env.sh
export PYTHONPATH=$PYTHONPATH:/tmp/xray:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/tmp/xray/bin:$PATH
source "$(dirname "$0")/plugin_entry_points.sh"
ulimit -n "$(ulimit -Hn)"
python3 -m loadtest.router_overhead --idle-flood "${FLOOD:-20000}" --rounds "${ROUNDS:-200}" --runs "${RUNS:-3}" \
  ${DECOY:+--decoy} --out "${OUT:-/tmp}/router_overhead_idle-gpu-host.json"
