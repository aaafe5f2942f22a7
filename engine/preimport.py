"""A vLLM server process that imports everything first and starts serving only when told.

    python -m engine.preimport engine.serving --model ... (vLLM's server arguments)

The process imports the server module (engine/serving.py: vLLM's OpenAI server; and, where vLLM
will fork its engine core from this process, the engine core's modules too), prints
PREIMPORTED_MARK, and waits for one line on stdin. On that line it calls the module's
`serve(args)`; on end of input (its owner is gone, or stopped it) it exits. So the seconds of Python imports, ~10-20 s of a vLLM start, are
paid before the start is asked for, and nothing touches the GPU until then: a pre-imported
process holds no device memory.

The environment is the engine's own, set when the process starts (engine/host.py).
"""

from __future__ import annotations

import importlib
import os
import sys

PREIMPORTED_MARK = "pdcluster: imported, waiting for the start"
"""The line the process prints once its imports are done (EngineHost marks the stage on it)."""

ENGINE_CORE_MODULES = ("vllm.v1.engine.core", "vllm.v1.worker.gpu_worker")
"""What a forked engine core runs that the server module does not import."""


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m engine.preimport SERVER_MODULE [ARGS...]", file=sys.stderr)
        return 2
    server = importlib.import_module(argv[0])
    # vLLM forks its engine core from the server process with "fork" (the CPU build insists on
    # spawn: the core then imports vLLM again) and only while CUDA is not initialized here, which
    # importing does not do.
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "fork":
        for module in ENGINE_CORE_MODULES:
            importlib.import_module(module)
    print(PREIMPORTED_MARK, flush=True)
    if not sys.stdin.readline():  # end of input: nobody will start this server
        return 0
    server.serve(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
