"""Device-to-device weights on the CPU build: the same pack/send/receive/verify code as on GPUs,
over gloo between two real processes; the GPU bench (loadtest/d2d_weights.py) runs it on NCCL."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.device_checksum import region_checksum
from engine.environment import free_port
from loadtest.device_transfer import pack, recv_weights, send_weights, unpack


def tensors() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        ("embed", torch.randn(37, 16, generator=generator).to(torch.bfloat16)),
        ("norm", torch.randn(17, generator=generator).to(torch.bfloat16)),  # odd: region padding
        ("proj", torch.randn(8, 24, generator=generator)),  # float32: a second region
        ("step", torch.tensor([3], dtype=torch.int64)),
    ]


def exchange(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 0:
            send_weights(*pack(tensors()), dst=1)
        else:
            layout, regions = recv_weights(src=0, device=torch.device("cpu"))
            received = unpack(layout, regions)
            # Plain data back: tensors in the queue would live in this process's shared memory.
            results.put({name: (str(received[name].dtype), torch.equal(received[name], sent))
                         for name, sent in tensors()})
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # a process or engine of its own: ~3 s
def test_weights_cross_processes_bit_identical_in_one_region_per_dtype():
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(exchange, args=(free_port("127.0.0.1"), results), nprocs=2, start_method="spawn")
    received = results.get()
    assert received == {name: (str(t.dtype), True) for name, t in tensors()}
    layout, regions = pack(tensors())
    assert sorted(regions) == ["bfloat16", "float32", "int64"]
    assert all(r.numel() * r.element_size() % 4 == 0 for r in regions.values())
    assert {n: torch.equal(t, dict(tensors())[n]) for n, t in unpack(layout, regions).items()} == {
        "embed": True, "norm": True, "proj": True, "step": True
    }


@pytest.mark.parametrize("damage", ["flip", "swap"])
def test_the_checksum_catches_flipped_and_reordered_words(damage):
    _, regions = pack(tensors())
    region = regions["float32"]
    before = region_checksum(region)
    words = region.view(torch.int32)
    if damage == "flip":
        words[5] ^= 1 << 20
    else:
        words[[3, 9]] = words[[9, 3]].clone()
    after = region_checksum(region)
    assert after != before
    if damage == "swap":
        assert after[0] == before[0]  # the plain sum misses a swap; the weighted one does not


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton checksum kernel needs a GPU")
def test_the_cuda_kernel_equals_the_torch_definition():
    from engine.device_checksum import checksum_torch

    generator = torch.Generator(device="cuda").manual_seed(3)
    # more than one 2^24-word chunk and a ragged last block; extreme words make products wrap
    words = torch.randint(-(2**31), 2**31 - 1, ((1 << 24) + 12345,), generator=generator,
                          device="cuda", dtype=torch.int32)
    words[:4] = torch.tensor([-(2**31), 2**31 - 1, -1, 0], dtype=torch.int32)
    assert region_checksum(words) == checksum_torch(words)
