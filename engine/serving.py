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

from vllm.entrypoints.openai import api_server  # the seconds of imports a pre-imported process saves

from engine.engine_args import vllm_serve_cli
from engine.environment import ENGINE_CORE_FORK_ENV
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


def _fork_the_engine_core(server_args: list[str]) -> None:
    """Where vLLM would spawn every child (the CPU build, platforms/cpu.py: a worker's OpenMP
    binding is the environment it is exec'd with), the engine core, which computes nothing, is
    forked from this process all the same, its imports done; the workers it starts still spawn.
    Not with `--numa-bind`, which vLLM applies by exec'ing its children under numactl."""
    if ENGINE_CORE_FORK_ENV not in os.environ or "--numa-bind" in server_args:
        return
    from vllm.v1.engine import utils as engine_utils

    if not hasattr(engine_utils, "get_mp_context"):  # else the patch would silently do nothing
        raise RuntimeError("vLLM starts its engine core elsewhere now: engine/serving.py must follow")
    engine_utils.get_mp_context = functools.partial(multiprocessing.get_context, "fork")


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
    _fork_the_engine_core(server_args)
    token = keys.engine_token

    def proves(headers: list[tuple[bytes, bytes]]) -> bool:
        authorization = next((value for name, value in headers if name == b"authorization"), b"")
        return bearer_matches(authorization.decode("latin-1"), token)

    protocol = guarded_protocol("engine", ListenerLimits.for_engine(), tls=keys.identity.server_context(),
                                proves=proves)
    uvloop.run(api_server.run_server(args, http=protocol))
