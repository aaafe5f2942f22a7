"""The engine process's server: vLLM's OpenAI server on the listening socket its host bound, behind
TLS with the process's own identity, under a guarded listener.

Its host binds the socket before the process exists and hands it over (LISTEN_FD_ENV), so no
other process can take the port first; vLLM would bind it itself seconds into its start, and a
local user watching for new engine processes could bind it in between. The TLS handshake, with
the identity the host made for this process (security/engine_access.py), is done by the
listener's own protocol once the connection is admitted (transport/listener_guard.py): a
stranger's idle or half-open connections are counted, timed and displaced like any other, and
only a connection whose request carries this process's token counts as proven.

vLLM's own entry point does the same steps (parse its arguments, check them, `run_server`) with
no socket or uvicorn protocol of ours; `run_server(args, **uvicorn_kwargs)` and the socket
factory beside `setup_server` are where vLLM 0.26 and 0.32 alike take them.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import socket
import sys
from collections.abc import Mapping

from vllm.entrypoints.openai import api_server  # the seconds of imports a pre-imported process saves

from engine.engine_args import vllm_serve_cli
from engine.environment import ENGINE_CHILDREN_FORK_ENV
from engine.server_command import LISTEN_FD_ENV
from security.credentials import EngineKeys, bearer_matches
from transport.listener_guard import ListenerLimits, guarded_protocol


def inherited_listener() -> socket.socket:
    """The listening socket the host handed over."""
    descriptor = int(os.environ[LISTEN_FD_ENV])
    listener = socket.socket(fileno=descriptor)
    # vLLM's engine core and workers need none of it: not across an exec (a spawned child), nor a
    # fork (the engine core; on CUDA the workers too), where a copy would keep the port taking
    # connections after the server died
    os.set_inheritable(descriptor, False)
    os.register_at_fork(after_in_child=listener.close)
    return listener


def _use_socket(listener: socket.socket) -> None:
    """Make vLLM's server serve on `listener` instead of binding its own."""
    module = sys.modules[api_server.setup_server.__module__]
    module.create_server_socket = lambda address, *, reuse_port=False: listener


def _fork_the_engine_children(numa_bind: bool) -> None:
    """Where vLLM would spawn every child (the CPU build, platforms/cpu.py: a worker's OpenMP
    binding is the environment it is exec'd with), the engine core is forked from this process all
    the same, its imports done, and so are the workers where they can be (`_workers_context`), each
    then binding itself to the cores that environment names (`_on_its_cores`). Not with
    `--numa-bind`, which vLLM applies by exec'ing its children under numactl."""
    if ENGINE_CHILDREN_FORK_ENV not in os.environ or numa_bind:
        return
    from vllm.v1.engine import utils as engine_utils
    from vllm.v1.executor import multiproc_executor

    if not hasattr(engine_utils, "get_mp_context") or not hasattr(multiproc_executor, "get_mp_context"):
        raise RuntimeError("vLLM starts its engine core or workers elsewhere now: engine/serving.py must follow")
    engine_utils.get_mp_context = functools.partial(multiprocessing.get_context, "fork")
    multiproc_executor.get_mp_context = _workers_context
    worker = multiproc_executor.WorkerProc
    # Pickled by name for a spawned worker, which runs vLLM's own `worker_main`.
    worker.worker_main = staticmethod(_on_its_cores(worker.worker_main))


@functools.cache  # one answer for the executor's lock and every worker it starts
def _workers_context() -> multiprocessing.context.BaseContext:
    """How the engine core starts its workers: forked, unless the scan for kernels to replace
    that vLLM runs at each worker's start, over every module the worker holds, fails on a module
    this process imported; spawned then, as vLLM has them (a spawned CPU worker imports vLLM
    again: ~35 s for two engines of two ranks on two cores, against ~2 s forked)."""
    try:
        from vllm.triton_utils import dispatcher

        # vLLM 0.32's scan reads `vars(value).get("kernel")` of every module attribute; llvmlite's
        # library wrapper (LMCache, a KV connector, brings it in through numba, as some multimodal
        # processors and parser plugins would) answers any attribute, `__dict__` too, with a C
        # function. The scan reads such an object as holding no kernel, which it does not.
        dispatcher.vars = _namespace
        dispatcher._rebind_kernels([])  # the scan itself, replacing nothing
    except Exception:
        return multiprocessing.get_context("spawn")
    return multiprocessing.get_context("fork")


def _namespace(value: object) -> Mapping:
    """`vars(value)`, or an empty namespace where what an object gives as its `__dict__` is none."""
    namespace = vars(value)
    return namespace if isinstance(namespace, Mapping) else {}


def _on_its_cores(worker_main):
    """A forked CPU worker's `worker_main`, run on the cores vLLM named for it in the environment it
    set for the fork, which GNU's OpenMP runtime, loaded before the fork, never reads: the process
    pinned to them, torch's threads one a core."""
    @functools.wraps(worker_main)
    def on_its_cores(*args, **kwargs):
        if cores := omp_cores(os.environ):
            import torch

            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        return worker_main(*args, **kwargs)
    return on_its_cores


def omp_cores(env: Mapping[str, str]) -> set[int]:
    """The cores vLLM names in `env` for a worker it starts, in the variable of the OpenMP runtime
    it finds preloaded, as vLLM picks it (utils/ompmultiprocessing.py `configure_omp_envs`): Intel's
    KMP_AFFINITY "...,proclist=[0,1]", GNU's GOMP_CPU_AFFINITY "0 1", else OMP_PLACES "{0,1}".
    Empty when vLLM binds none (VLLM_CPU_OMP_THREADS_BIND=nobind)."""
    preloaded = env.get("LD_PRELOAD", "")
    if "libiomp" in preloaded or "libomp" in preloaded:
        listed = env.get("KMP_AFFINITY", "").partition("proclist=[")[2].partition("]")[0]
    elif "libgomp" in preloaded:
        listed = env.get("GOMP_CPU_AFFINITY", "")
    else:
        listed = env.get("OMP_PLACES", "").strip("{}")
    return {int(core) for core in listed.replace(",", " ").split()}


def serve(server_args: list[str]) -> None:
    """vLLM's OpenAI server with `server_args`, on the host's socket, TLS and guard ours."""
    import uvloop
    from vllm import logger as vllm_logger
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    make_arg_parser, validate_parsed_serve_args = vllm_serve_cli()
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-compatible server (pdcluster engine)"))
    args = parser.parse_args(server_args)
    configure_logging = getattr(vllm_logger, "configure_logging_from_args", None)  # vLLM 0.32; not in 0.26
    if configure_logging is not None:
        configure_logging(args)
    validate_parsed_serve_args(args)
    keys = EngineKeys.load()
    _use_socket(inherited_listener())
    _fork_the_engine_children(getattr(args, "numa_bind", False))  # vLLM 0.26 has no such flag
    token = keys.engine_token

    def proves(headers: list[tuple[bytes, bytes]]) -> bool:
        authorization = next((value for name, value in headers if name == b"authorization"), b"")
        return bearer_matches(authorization.decode("latin-1"), token)

    protocol = guarded_protocol("engine", ListenerLimits.for_engine(), tls=keys.identity.server_context(),
                                proves=proves)
    uvloop.run(api_server.run_server(args, http=protocol))
