"""Sealing a worker's listeners (transport/listener_warden.py) never touches a socket it inherited
by fork: on CUDA vLLM forks its workers (from the engine core, forked from the API server), and a
filter on the API server's listener or the KV-event sockets would shut them for every process
that shares them (the H200 saw its engine's HTTP port refuse everything once a worker sealed)."""

from __future__ import annotations

import os
import socket

from transport.listener_warden import seal_tcp_listeners


def test_a_forked_worker_seals_its_own_listeners_not_its_parents():
    parents = socket.create_server(("127.0.0.1", 0))
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the worker: a listener of its own (a gloo group's, say), then the seal
        try:
            own = socket.create_server(("127.0.0.1", 0))
            sealed = seal_tcp_listeners()
            os.write(write, f"{own.getsockname()[1]} {' '.join(map(str, sealed))}".encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    own_port, *sealed = map(int, os.read(read, 4096).split())
    assert sealed == [own_port]
    parents.settimeout(5)
    with socket.create_connection(parents.getsockname(), timeout=5):
        connection, _ = parents.accept()  # the parent's listener still takes connections
        connection.close()
    parents.close()
