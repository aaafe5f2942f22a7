"""TCP listeners of this process that a stranger must not exhaust, whose accept loops belong to a
library and cannot be bounded as our HTTP servers are (transport/listener_guard.py): UCX's (the
NIXL agents of the weight plane, the store and vLLM's NixlConnector) and ZMQ's (the KV events'
sockets, the store shards' control sockets), each made inside `watched_listeners()` and kept few
and short by the `ListenerWarden`; and those whose peers have all connected (a vLLM worker's
torch.distributed groups), sealed by `seal_tcp_listeners` (docs/security.md, attack 11.3)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable, Iterator

log = logging.getLogger(__name__)

# UCT's TCP interface (a listener per UCX worker, on the node's address) accepts every connection
# and keeps it, with a descriptor, until the client closes it: no deadline for a first message.
# A stranger opens ~45,000 idle connections a second on loopback, and at the process's descriptor
# limit (20,000 here) a failed accept makes UCX close its listener for good. A peer of ours sends
# its hello (UCX's 8-byte magic number and connection request; 116-184 bytes seen) in the call
# that connects, as a ZMQ peer sends its 64-byte ZMTP greeting (ZMQ gives a silent one 30 s), so
# a connection still short of HELLO_BYTES after SILENT_GRACE_S is none of ours.
HELLO_BYTES = 24
SILENT_GRACE_S = 0.25
SILENT_CAP = 512
"""Silent connections beyond which this process's UCX listeners take no new ones for a while."""
LISTEN_BACKLOG = 128
"""Connections the kernel completes for a listener ahead of UCX's accept (UCX asks for 4096): what
a paused listener still hands UCX."""
TICK_S = 0.02
ALERT_TICK_S = 0.002  # while silent connections are open or the listeners paused
FULL_SWEEP_S = 1.0  # otherwise a sweep runs only when the process's descriptor count changed
_TCP_CLOSE_WAIT = 8
_TCP_INFO_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received in struct tcp_info (Linux >= 4.1)
_SO_ATTACH_FILTER, _SO_DETACH_FILTER = 26, 27
_DROP_EVERYTHING = ctypes.create_string_buffer(struct.pack("=HBBI", 0x06, 0, 0, 0))  # BPF: ret 0
_DROP_EVERYTHING_PROGRAM = struct.pack("@HP", 1, ctypes.addressof(_DROP_EVERYTHING))  # sock_fprog


class ListenerWarden:
    """Keeps the connections that never said hello to this process's watched listeners few and short.

    - Each is shut down (shutdown(2) on a duplicate of its descriptor) SILENT_GRACE_S after a sweep
      first saw it; the library (UCX progressing its worker, ZMQ's I/O thread) then reads the end
      of the stream and closes it.
    - While more than SILENT_CAP are open, the listeners take no new connection: a socket filter
      drops what arrives for them, in the kernel (a client's SYN is sent again 1 s, 3 s, ... later;
      established connections are not affected). So they hold about SILENT_CAP descriptors at
      most, plus the LISTEN_BACKLOG each and what UCX accepts before the warden notices (TICK_S).
    Idle, it costs ~35 us a tick (a count of /proc/self/fd), a sweep when that count changed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = 0
        self._reset()

    def _reset(self) -> None:
        self.listeners: dict[int, tuple[int, int]] = {}  # inode -> (descriptor, port)
        self.shed = 0  # connections shut down, in all
        self.pauses = 0  # times the listeners stopped taking connections
        self.paused = False
        self._ports: set[int] = set()
        self._settled: set[int] = set()  # socket inodes judged for good: not ours to shed, or greeted
        self._first_seen: dict[int, float] = {}  # silent accepted connections: inode -> first seen
        self._others = 0  # descriptors besides silent connections, at the last sweep (or watch)
        self._count, self._next_full, self._next_sweep, self._next_log, self._logged = -1, 0.0, 0.0, 0.0, 0

    def watch(self, listeners: dict[int, tuple[int, int]]) -> None:
        """Watch these TCP listeners of this process (from now on, in a thread of its own)."""
        with self._lock:
            if self._pid != os.getpid():  # none yet, or a fork's copy of the parent's (threadless)
                self._reset()
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="pdc-ucx-warden", daemon=True).start()
            self.listeners.update(listeners)
            self._ports = {port for _, port in self.listeners.values()}
            self._next_full = 0.0
            # Counted now, not left for the first sweep: a tick before it would take a process's
            # own descriptors (a vLLM worker holds hundreds) for silent connections and pause.
            self._others = len(os.listdir("/proc/self/fd")) - len(self._first_seen)

    def _run(self) -> None:
        next_error_log = 0.0
        while True:
            time.sleep(ALERT_TICK_S if self.paused or self._first_seen else TICK_S)
            try:
                self.tick()
            except Exception:  # never let the warden die; the next tick tries again
                if time.monotonic() >= next_error_log:
                    log.exception("UCX listener warden: a tick failed (logged once a minute)")
                    next_error_log = time.monotonic() + 60.0

    def tick(self) -> None:
        descriptors = os.listdir("/proc/self/fd")
        now = time.monotonic()
        with self._lock:
            if not self.paused and len(descriptors) > self._others + SILENT_CAP:
                self._pause(True)  # before the sweep, which takes a while with that many
            if now >= self._next_sweep and (len(descriptors) != self._count or self._first_seen
                                            or now >= self._next_full):
                self._sweep(descriptors, now)

    def _sweep(self, descriptors: list[str], now: float) -> None:
        """Judge the accepted connections of the watched listeners not judged for good yet."""
        self._count, self._next_full, self._next_sweep = len(descriptors), now + FULL_SWEEP_S, now + TICK_S
        present = socket_descriptors(descriptors)
        for inode, fd in present.items():
            seen = self._first_seen.get(inode)
            if inode not in self._settled and (seen is None or now - seen >= SILENT_GRACE_S):
                self._judge(fd, inode, now)
                if len(self._first_seen) > SILENT_CAP and not self.paused:  # a sweep takes a while
                    self._pause(True)
        self._settled &= present.keys()
        for gone in self.listeners.keys() - present.keys():  # its agent is gone: its port may be reused
            del self.listeners[gone]
            self._ports = {port for _, port in self.listeners.values()}
        self._first_seen = {inode: seen for inode, seen in self._first_seen.items() if inode in present}
        self._others = len(descriptors) - len(self._first_seen)
        if not self.paused and len(self._first_seen) > SILENT_CAP:
            self._pause(True)
        elif self.paused and len(self._first_seen) <= SILENT_CAP // 2:
            self._pause(False)
        if self.shed > self._logged and now >= self._next_log:
            log.warning("UCX listeners: shut %d connections that sent no hello within %.2f s (%d in all; "
                        "paused %d times)", self.shed - self._logged, SILENT_GRACE_S, self.shed, self.pauses)
            self._logged, self._next_log = self.shed, now + 60.0

    def _judge(self, fd: int, inode: int, now: float) -> None:
        conn = _duplicate(fd, inode)
        if conn is None:  # closed, or the number reused, meanwhile: the next sweep sees
            return
        with conn:
            try:
                self._judge_connection(conn, inode, now)
            except OSError:  # its peer reset it, or it is no connection at all: judged for good
                self._settled.add(inode)

    def _judge_connection(self, conn: socket.socket, inode: int, now: float) -> None:
        if (inode in self.listeners or conn.family not in (socket.AF_INET, socket.AF_INET6)
                or conn.type != socket.SOCK_STREAM or conn.getsockname()[1] not in self._ports):
            self._settled.add(inode)  # not a connection a watched listener accepted
            return
        info = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        if len(info) < _TCP_INFO_BYTES_RECEIVED + 8:  # a kernel older than 4.1 does not count them
            self._settled.add(inode)
            return
        if struct.unpack_from("=Q", info, _TCP_INFO_BYTES_RECEIVED)[0] >= HELLO_BYTES:
            self._settled.add(inode)
            return
        seen = self._first_seen.setdefault(inode, now)
        if info[0] == _TCP_CLOSE_WAIT or now - seen >= SILENT_GRACE_S:
            conn.shutdown(socket.SHUT_RDWR)
            self.shed += 1
            self._settled.add(inode)
            del self._first_seen[inode]

    def _pause(self, paused: bool) -> None:
        """Drop (or again take) what arrives for the listeners; forget the ones that are gone."""
        for inode, (fd, _) in list(self.listeners.items()):
            listener = _duplicate(fd, inode)
            if listener is None:  # its agent is gone
                del self.listeners[inode]
                continue
            with listener, contextlib.suppress(OSError):  # detaching when none is attached
                if paused:
                    listener.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, _DROP_EVERYTHING_PROGRAM)
                else:
                    listener.setsockopt(socket.SOL_SOCKET, _SO_DETACH_FILTER, 0)
        self._ports = {port for _, port in self.listeners.values()}
        self.pauses += paused
        self.paused = paused


WARDEN = ListenerWarden()


@contextlib.contextmanager
def watched_listeners() -> Iterator[None]:
    """Hand the TCP listeners this process opens inside the block (a NIXL backend's, a ZMQ
    socket's bind) to the warden."""
    before = set(socket_descriptors())
    yield
    WARDEN.watch(tcp_listeners(set(socket_descriptors()) - before))



_inherited: set[int] = set()
"""Socket inodes this process had when it was forked: its parent's, whatever they are (vLLM on
CUDA forks its engine core from the API server and its workers from the engine core, which
inherit the HTTP listener and the KV-event sockets): never sealed here, a filter on a socket
holds for every process that shares it."""


def _note_inherited() -> None:
    _inherited.clear()
    _inherited.update(socket_descriptors())


os.register_at_fork(after_in_child=_note_inherited)


def seal_tcp_listeners() -> list[int]:
    """Make every TCP listener this process made itself, but the UCX ones the warden watches,
    drop whatever arrives for it from now on (a socket filter; established connections are not
    affected); returns their ports. For listeners whose peers have all connected: a vLLM
    worker's torch.distributed groups (a gloo listener each, and the TCPStore, on all addresses)
    never take a connection again once made, yet they leave every connection a client closed in
    CLOSE-WAIT, and at the descriptor limit a failed accept ends the process (gloo's
    GLOO_ENFORCE): 15 of the 16 listeners of vLLM 0.32's distributed state did so here."""
    sealed = []
    for inode, (fd, port) in tcp_listeners(socket_descriptors(), backlog=None).items():
        listener = _duplicate(fd, inode) if inode not in WARDEN.listeners.keys() | _inherited else None
        if listener is not None:
            with listener:
                listener.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, _DROP_EVERYTHING_PROGRAM)
            sealed.append(port)
    return sealed

def socket_descriptors(descriptors: Iterable[str] | None = None) -> dict[int, int]:
    """This process's sockets: inode -> descriptor."""
    sockets = {}
    for name in os.listdir("/proc/self/fd") if descriptors is None else descriptors:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            sockets[int(link[8:-1])] = int(name)
    return sockets


def _duplicate(fd: int, inode: int) -> socket.socket | None:
    """Socket `inode` through a duplicate of descriptor `fd` (closing it closes the duplicate
    only: the descriptor stays its owner's), or None if `fd` no longer is that socket."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(duplicate).st_ino == inode:
            return socket.socket(fileno=duplicate)
    except OSError:
        pass
    os.close(duplicate)
    return None


def tcp_listeners(inodes: Iterable[int], backlog: int | None = LISTEN_BACKLOG) -> dict[int, tuple[int, int]]:
    """Those of these sockets (of this process) that are TCP listeners: inode -> (fd, port), their
    backlog set to `backlog` unless None."""
    descriptors, listeners = socket_descriptors(), {}
    for inode in inodes:
        sock = _duplicate(descriptors[inode], inode) if inode in descriptors else None
        if sock is None:
            continue
        with sock:
            if (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                    and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                if backlog is not None:
                    sock.listen(backlog)  # on a listening socket: only its backlog changes
                listeners[inode] = (descriptors[inode], sock.getsockname()[1])
    return listeners
