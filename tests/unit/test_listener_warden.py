"""The UCX listener warden (transport/listener_warden.py) leaves a busy process's listeners open:
the descriptors a process holds of its own (files, pipes, a vLLM worker's hundreds) are not a
stranger's silent connections, so watching a new listener pauses nothing, even before its first
sweep, and a peer's connection is taken at once."""

from __future__ import annotations

import os
import socket

from transport.listener_warden import SILENT_CAP, ListenerWarden, socket_descriptors, tcp_listeners


def test_a_process_with_many_descriptors_of_its_own_watches_a_listener_without_pausing_it():
    own = [os.open(os.devnull, os.O_RDONLY) for _ in range(SILENT_CAP + 100)]
    try:
        before = set(socket_descriptors())
        with socket.create_server(("127.0.0.1", 0)) as listener:
            warden = ListenerWarden()
            warden.watch(tcp_listeners(set(socket_descriptors()) - before))
            assert list(warden.listeners.values())[0][1] == listener.getsockname()[1]
            warden.tick()  # the first, before any sweep has counted the process's descriptors
            assert (warden.pauses, warden.paused) == (0, False)
            listener.settimeout(5)
            with socket.create_connection(listener.getsockname(), timeout=1):
                listener.accept()[0].close()
    finally:
        for fd in own:
            os.close(fd)
