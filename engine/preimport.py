"""A vLLM server process that imports everything first and starts serving only when told.

    python -m engine.preimport vllm.entrypoints.openai.api_server --model ... (the server's args)

The process imports the server module (and, where the engine core is forked from vLLM's
forkserver, starts that forkserver with the engine core's modules imported), prints
PREIMPORTED_MARK, and waits for one line on stdin. On that line it runs the server module as
`python -m` would; on end of input (its owner is gone, or stopped it) it exits. So the seconds of
Python imports, ~10-20 s of a vLLM start, are paid before the start is asked for, and nothing
touches the GPU until then: a pre-imported process holds no device memory.

The environment is the engine's own, set when the process starts (engine/host.py): the
forkserver's children inherit it from there.
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import sys

PREIMPORTED_MARK = "pdcluster: imported, waiting for the start"
"""The line the process prints once its imports are done (EngineHost marks the stage on it)."""

ENGINE_CORE_MODULES = ("vllm.v1.engine.async_llm", "vllm.v1.engine.core", "vllm.v1.worker.gpu_worker")
"""What the forkserver imports for the engine core processes it forks (vLLM itself preloads only
the first)."""


def _start_forkserver() -> None:
    """With VLLM_WORKER_MULTIPROC_METHOD=forkserver vLLM forks its engine core from the forkserver
    (vllm/entrypoints/openai/api_server.py, build_async_engine_client), which it starts at the
    engine's start and which then imports vLLM again. Started here, ahead, the forkserver is
    running when vLLM asks for it, and vLLM's own `ensure_running()` keeps it. The start method
    is left for vLLM to set: vLLM sets it without `force`, which raises once it is set, and
    starting the forkserver sets it (multiprocessing.spawn.get_preparation_data asks for it), so
    it is unset again."""
    multiprocessing.set_forkserver_preload(list(ENGINE_CORE_MODULES))
    multiprocessing.forkserver.ensure_running()
    multiprocessing.set_start_method(None, force=True)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m engine.preimport SERVER_MODULE [ARGS...]", file=sys.stderr)
        return 2
    server_module, server_args = argv[0], argv[1:]
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "forkserver":
        _start_forkserver()
    importlib.import_module(server_module)
    print(PREIMPORTED_MARK, flush=True)
    if not sys.stdin.readline():  # end of input: nobody will start this server
        return 0
    sys.argv = [server_module, *server_args]
    runpy.run_module(server_module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
