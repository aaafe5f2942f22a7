# Several models behind one router on one H200, taking turns (issue #23 goals 2-3): `pdcluster serve`
# on a Ray head of its own, driven by loadtest.multi_model. vLLM 0.26, torch 2.11, Python 3.12.
# Calls before this one (each within 30 s of the last) copy .vchunks/part00..02 into /tmp/vparts and
# .gpuray/part0..1 (Ray 2.60.0 for Python 3.12 and the base dependencies the image lacks) into
# /tmp/rayparts. Then, from the repository root: bash docs/gpu/h200/run_multimodel.sh [MODEL] [COUNT]
#   MODEL: a builder of engine.models (default llama1b); COUNT distinct checkpoints (derive_checkpoints);
#   GRAPHS=1: CUDA graphs (engines start one after another: ~95 s each for the 8B shape)
set -eo pipefail
[ -d /tmp/site ] || bash /tmp/vparts/install.sh > /tmp/install.log 2>&1
[ -d /tmp/xray ] || bash /tmp/rayparts/install-ray.sh > /tmp/install-ray.log 2>&1
source /tmp/vparts/env.sh
export PYTHONPATH=$PYTHONPATH:/tmp/xray:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/tmp/xray/bin:$PATH
name=${1:-llama1b}; count=${2:-2}
python3 -c "import sys; from pathlib import Path; from engine.models import ensure_model; ensure_model(sys.argv[1], Path(sys.argv[2]))" "$name" "/tmp/models/$name"
models=$(python3 -c "import sys; from pathlib import Path; from engine.models import derive_checkpoints; print(','.join(map(str, derive_checkpoints(Path(sys.argv[1]), int(sys.argv[2])))))" "/tmp/models/$name" "$count")
python3 -m loadtest.multi_model --models "$models" --bursts "${BURSTS:-6}" --burst-size 3 --pause "${PAUSE:-3}" \
  --out "${OUT:-/tmp}/multi_model-h200-$name.json" -- --sleep-when-idle --engines-per-gpu "$count" --max-awake 1 \
  --gpu-memory-utilization "${UTIL:-0.4}" --max-model-len 2048 --start-timeout 300 ${GRAPHS:+--no-eager}
