"""An engine server's process group (engine/process.py) with a real group of processes standing
in for vLLM's: the shared-memory files vLLM's processes map, which a killed group leaves in
/dev/shm (host memory), are removed when its host stops it, and no other file is."""

from __future__ import annotations

import os
import secrets
import signal
import sys
from pathlib import Path

from engine.process import group_shared_memory, spawn_group, terminate_group

SHM = Path("/dev/shm")

# One of each kind of file vLLM makes (a multiprocessing SharedMemory, as its broadcast queues are;
# a file named as the CPU build's tensor-parallel communicator's), and a file vLLM did not make.
GROUP_MEMBER = """
import mmap, os, sys, time
from multiprocessing import shared_memory
queue = shared_memory.SharedMemory(create=True, size=1 << 20)
mapped = []
for path in sys.argv[1:]:
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(descriptor, 1 << 20)
    mapped.append(mmap.mmap(descriptor, 1 << 20))
print(queue.name, flush=True)
time.sleep(600)
"""


def test_the_shared_memory_of_a_killed_group_is_removed_at_stop_and_nothing_else():
    communicator = SHM / f"vllm_dist_{secrets.token_hex(16)}-tp:0-[0-1]-cpushm_0"
    other = SHM / f"pdcluster-test-{secrets.token_hex(8)}"
    process = spawn_group([sys.executable, "-c", GROUP_MEMBER, str(communicator), str(other)], os.environ.copy(), ())
    try:
        queue = SHM / process.stdout.readline().strip()
        assert queue.name.startswith("psm_")
        seen = group_shared_memory(process.pid)
        assert seen == {queue, communicator}
        os.killpg(process.pid, signal.SIGKILL)  # as a lost engine: nothing of vLLM's cleans up
        process.wait(10)
        assert queue.exists() and communicator.exists()
        terminate_group(process, grace_s=1, shared_memory=seen)
        assert not queue.exists() and not communicator.exists()
        assert other.exists()
    finally:
        terminate_group(process, grace_s=1)
        for path in (communicator, other):
            path.unlink(missing_ok=True)
