# Sourced by run_pd_goodput.sh and run_profile.sh: vLLM 0.26 from /tmp/vparts, NIXL from the
# wheels in /tmp/xw (see those scripts), NVLink multicast off, and the 8B Llama's shape without
# weights at /tmp/m8b (engines keep vLLM's dummy weights), written in a process of its own before
# any engine starts.
[ -d /tmp/site ] || bash /tmp/vparts/install.sh > /tmp/install.log 2>&1
source /tmp/vparts/env.sh
[ -d /tmp/xsite/nixl ] || python3 -m pip install -q --no-index --no-deps --target /tmp/xsite /tmp/xw/*.whl
export PATH=/tmp/xsite/bin:$PATH PYTHONPATH=$PYTHONPATH:/tmp/xsite:$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -f /tmp/m8b/config.json ] || python3 -c "from pathlib import Path; from engine.models import write_llama8b_shape; write_llama8b_shape(Path('/tmp/m8b'))"
