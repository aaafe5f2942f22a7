# Sleeping standbys on the lent H200 (issue #23; vLLM 0.26, torch 2.11, Python 3.12, no network).
# Calls before this one (each within 30 s of the last) copy the parts docs/gpu/h200/wheelhouse.sh
# makes (.vchunks/part00..03) into /tmp/vparts.
# Then, from the repository root: bash docs/gpu/h200/run_sleep.sh test|cold1b|cold8b
#   test:   tests/conformance/test_conformance_gpu.py (disk, CUDA IPC standby, sleeping standby)
#   cold1b: loadtest.cold_start, the tied ~1B Llama, standby vs sleeping, CUDA graphs
#   cold8b: the same on a random 8B Llama (built on the GPU in its own process, 16 GB)
#   fresh1b|fresh8b: loadtest.cold_start from nothing: plain vLLM (PATHS: plain, plain-plan), ours
#           from disk, ours from a pre-imported process (engine/preimport.py), CUDA graphs; with
#           IMPORTTIME=1 also vLLM's import profile
#   swap1b|swap8b: loadtest.model_swap, four distinct checkpoints (derive_checkpoints: the output
#           head re-drawn, every other file hard-linked), one awake at a time, CUDA graphs
#   graphs8b: loadtest.graph_sizes, time per token at several batches with vLLM's default CUDA graph
#           capture sizes against a short list, and each engine's start (issue #36 goal 2); the 8B
#           shape with vLLM's dummy weights (time per token does not depend on their values);
#           GRAPH_VARIANTS: loadtest.graph_sizes VARIANTS besides vLLM's default (default: short)
#   ENGINE_ARG: one `--engine-arg` value for our engines in cold*/fresh* (plain vLLM keeps its
#           defaults), e.g. ENGINE_ARG="--cudagraph-capture-sizes 1 2 4 8 16 32"; our levers among
#           vLLM's variables (loadtest.cold_start OUR_LEVERS) are taken from this shell
#   extras1b: loadtest.engine_extras, decode throughput of vLLM's engine with our logits processor
#           and with our KV event publisher against plain, the ~1B Llama, CUDA graphs; VARIANTS, CPUS
#           (cores every engine is pinned to), RUNS, REPEATS, BATCH, TOKENS from this shell
#   caches: the size and file count of each cache a start may fill (vLLM's, Triton's, FlashInfer's,
#           CUDA's, Inductor's): run before and after a fresh machine's first start (issue #36 goal 3)
#   newnode1b|newnode8b: fresh1b|fresh8b with PATHS (default preimported,empty-caches,new-node: a node
#           that never ran the model, without and with a peer's caches, issue #36 goal 3), `caches`
#           before and after, and every file the starts wrote anywhere, by folder
set -eo pipefail
[ -d /tmp/site ] || bash /tmp/vparts/install.sh > /tmp/install.log 2>&1
source /tmp/vparts/env.sh
export PYTHONPATH=$PYTHONPATH:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PDC_CUDA_MODEL_DIR=/tmp/models
source "$(dirname "$0")/plugin_entry_points.sh"  # our engines load our vLLM plugins, as where pip-installed
# Models are built in a process of their own, before any engine starts.
ours=(); [ -z "$ENGINE_ARG" ] || ours=(--engine-arg="$ENGINE_ARG")
build() { python3 -c "import sys; from pathlib import Path; from engine.models import ensure_model; ensure_model(sys.argv[1], Path(sys.argv[2]))" "$1" "/tmp/models/$1"; }
case "$1" in
  test) shift; python3 -m pytest tests/conformance/test_conformance_gpu.py -v -s -p no:cacheprovider --timeout 560 "$@" ;;
  cold1b) build llama1b-tied
          python3 -m loadtest.cold_start --model /tmp/models/llama1b-tied --no-eager --paths standby,sleeping "${ours[@]}" \
            --runs "${RUNS:-3}" --out "${OUT:-/tmp}/cold_start-m1b-sleeping.json" ;;
  cold8b) build llama8b
          python3 -m loadtest.cold_start --model /tmp/models/llama8b --no-eager --paths standby,sleeping "${ours[@]}" \
            --runs "${RUNS:-2}" --out "${OUT:-/tmp}/cold_start-m8b-sleeping.json" ;;
  fresh1b|fresh8b) name=llama${1#fresh}; build "$name"  # from nothing: plain vLLM, ours, ours pre-imported
          [ -z "$IMPORTTIME" ] || python3 -X importtime -c "import vllm.entrypoints.openai.api_server" 2> "${OUT:-/tmp}/importtime.txt"
          python3 -m loadtest.cold_start --model "/tmp/models/$name" --no-eager --paths "${PATHS:-plain,disk,preimported}" "${ours[@]}" \
            --runs "${RUNS:-2}" --out "${OUT:-/tmp}/cold_start-m${1#fresh}-fresh.json" --engine-log-dir /tmp/engine-logs
          grep -hi "startup plan" /tmp/engine-logs/*.log > "${OUT:-/tmp}/startup-plan.txt" || true
          tar -czf "${OUT:-/tmp}/engine-logs.tgz" -C /tmp engine-logs ;;
  swap1b|swap8b) name=llama${1#swap}; build "$name"
          models=$(python3 -c "import sys; from pathlib import Path; from engine.models import derive_checkpoints; print(','.join(map(str, derive_checkpoints(Path(sys.argv[1]), 4))))" "/tmp/models/$name")
          python3 -m loadtest.model_swap --models "$models" $([ -n "$EAGER" ] || echo --no-eager) --rounds "${ROUNDS:-8}" \
            --out "${OUT:-/tmp}/model_swap-m${1#swap}.json" ;;
  graphs8b) [ -f /tmp/m8b/config.json ] || python3 -c "from pathlib import Path; from engine.models import write_llama8b_shape; write_llama8b_shape(Path('/tmp/m8b'))"
          python3 -m loadtest.graph_sizes --model /tmp/m8b --load-format dummy --runs "${RUNS:-2}" --variants ${GRAPH_VARIANTS:-short} --out "${OUT:-/tmp}/graph_sizes-m8b.json" ;;
  extras1b) build llama1b-tied
          python3 -m loadtest.engine_extras --model /tmp/models/llama1b-tied --no-eager --variants ${VARIANTS:-plain logits_processor kv_events} \
            ${CPUS:+--cpus "$CPUS"} --runs "${RUNS:-3}" --repeats "${REPEATS:-1}" --batch "${BATCH:-32}" --tokens "${TOKENS:-256}" --out "${OUT:-/tmp}/engine_extras-m1b.json" ;;
  caches) for dir in "$VLLM_CACHE_ROOT" ~/.cache/vllm ~/.triton/cache ~/.cache/flashinfer ~/.nv/ComputeCache /tmp/torchinductor_*; do
            [ -e "$dir" ] && echo "$(du -sm "$dir" | cut -f1) MB $(find "$dir" -type f | wc -l) files $dir"
          done; true ;;
  newnode1b|newnode8b) bash "$0" caches > "${OUT:-/tmp}/caches-before.txt"; touch /tmp/newnode-mark
          PATHS=${PATHS:-preimported,empty-caches,new-node} bash "$0" "fresh${1#newnode}"
          bash "$0" caches > "${OUT:-/tmp}/caches-after.txt"
          find / -xdev -type f -newer /tmp/newnode-mark -not -path '/proc/*' -printf '%s %h\n' 2>/dev/null \
            | awk '{n = split($2, p, "/"); k = "/" p[2] "/" p[3] "/" p[4]; b[k] += $1; c[k]++}
                   END {for (k in b) printf "%9.1f MB %6d files %s\n", b[k] / 1e6, c[k], k}' \
            | sort -rn > "${OUT:-/tmp}/written-by-starts.txt" ;;
  *) echo "usage: $0 test|cold1b|cold8b|fresh1b|fresh8b|swap1b|swap8b|graphs8b|extras1b|caches|newnode1b|newnode8b" >&2; exit 2 ;;
esac
