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

from engine.environment import ENGINE_CHILDREN_FORK_ENV

PREIMPORTED_MARK = "pdcluster: imported, waiting for the start"
"""The line the process prints once its imports are done (EngineHost marks the stage on it)."""

ENGINE_CORE_MODULES = ("vllm.v1.engine.core",)
"""What a forked engine core runs that the server module does not import."""
CUDA_WORKER_MODULES = ("vllm.v1.worker.gpu_worker",)
CPU_WORKER_MODULES = ("vllm.v1.worker.cpu_worker",)
"""What forked workers run besides, on each build."""


def forked_children_modules() -> tuple[str, ...]:
    """The modules of the children vLLM will fork from this process, the engine core and its
    workers (engine/server_command.py `server_env` says on which build and how)."""
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "fork":
        return ENGINE_CORE_MODULES + CUDA_WORKER_MODULES
    return ENGINE_CORE_MODULES + CPU_WORKER_MODULES if ENGINE_CHILDREN_FORK_ENV in os.environ else ()


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m engine.preimport SERVER_MODULE [ARGS...]", file=sys.stderr)
        return 2
    server = importlib.import_module(argv[0])
    # A child vLLM forks (only while CUDA is not initialized here, which importing does not do)
    # finds its modules imported; a spawned one imports vLLM again.
    for module in forked_children_modules():
        importlib.import_module(module)
    print(PREIMPORTED_MARK, flush=True)
    if not sys.stdin.readline():  # end of input: nobody will start this server
        return 0
    server.serve(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
