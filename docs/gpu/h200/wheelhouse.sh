#!/usr/bin/env bash
# The wheel parts each visit to the lent GPU carries (.vchunks/part00..03): vLLM 0.26.0 as
# ../shared/gpu/build-vllm-wheelhouse.sh builds it, plus what pdcluster imports there that the
# image lacks: httpx and its parts, cryptography (engine identities, LMCache), httptools (our
# uvicorn protocol), numpy. Without them every start fails at `import cryptography`.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
EXTRA_WHEELS="httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 idna==3.20 certifi==2026.10.19.post1
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 httptools==0.9.0 numpy==2.4.6" \
  exec bash "$ROOT/../shared/gpu/build-vllm-wheelhouse.sh"
