"""Weight loading paths against the link they use, on a two-GPU machine (or on CPU, small).

    python -m loadtest.d2d_weights [--gib 8] [--tensors 290] [--runs 5]

In one run, for a model-sized set of bf16 tensors (shapes like a Llama's layers):
  link_copy     - a plain `tensor.to('cuda:1')` of one flat buffer of the same size (the ceiling);
  ours_nccl     - loadtest.device_transfer: GPU 0's process sends its per-dtype regions to GPU 1's
                  process over NCCL; the receiver verifies checksums on the device;
  ours_ipc      - the same node's fast path: GPU 1's process opens GPU 0's regions by CUDA IPC
                  and copies them peer to peer, then verifies;
  verify        - the receiver's checksum pass alone (inside both of the above): one Triton
                  kernel on CUDA; verify_torch is the same sums in torch passes (must agree);
  device_copy   - a plain copy of the flat buffer within GPU 0 (the same-GPU ceiling);
  ipc_same_gpu  - the same-GPU hand-over: another process copies GPU 0's regions by CUDA IPC
                  into new memory on GPU 0, then verifies (a standby taking a warm peer's weights);
  pinned_h2d    - the bytes from pinned host memory to GPU 1 (one copy, the host path's ceiling);
  disk_to_gpu   - engine.checkpoint.read_from_disk of the same tensors saved as safetensors (page
                  cache warm), then host-to-device.
Medians of `--runs`; prints a table, writes JSON. The receiver's tensors are compared bit for bit
with the sender's (sender computes a reference checksum per tensor, receiver the same).
Without two GPUs it runs the same code on CPU with gloo (for a smoke check only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.device_checksum import checksum_torch, region_checksum
from loadtest.device_transfer import (
    checksums,
    fetch_ipc,
    ipc_handles,
    pack,
    recv_weights,
    send_weights,
    unpack,
)

SAME_GPU = ("device_copy", "ipc_same_gpu")


def model_like_shapes(total_bytes: int, tensors: int) -> list[tuple[str, tuple[int, ...]]]:
    """Per layer: qkv, o, gate_up, down, two norms; hidden size chosen to fill total_bytes."""
    layers = max(1, tensors // 6)
    hidden = 256
    while layers * (3 + 1 + 8 + 4) * (hidden + 256) ** 2 * 2 <= total_bytes:
        hidden += 256
    shapes = []
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.qkv_proj.weight", (3 * hidden, hidden)), (f"{p}.o_proj.weight", (hidden, hidden)),
                   (f"{p}.gate_up_proj.weight", (8 * hidden, hidden)), (f"{p}.down_proj.weight", (hidden, 4 * hidden)),
                   (f"{p}.input_layernorm.weight", (hidden,)), (f"{p}.post_attention_layernorm.weight", (hidden,))]
    return shapes


def make_tensors(shapes, device) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator(device=device).manual_seed(0)
    return [(n, torch.randn(s, generator=generator, device=device, dtype=torch.float32).to(torch.bfloat16))
            for n, s in shapes]


def write_checkpoint(folder: Path, gib: float, tensors: int) -> None:
    """A model-like checkpoint in four safetensors shards, as real ones are."""
    from safetensors.torch import save_file

    named = dict(make_tensors(model_like_shapes(int(gib * 1024**3), tensors), torch.device("cpu")))
    (folder / "config.json").write_text("{}")
    names = list(named)
    for part in range(4):
        save_file({n: named[n] for n in names[part::4]}, str(folder / f"model-{part}.safetensors"))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, runs: int, before=None) -> list[float]:
    """Seconds per run of `fn`, the device synchronised around it; `before()` runs untimed
    ahead of each run."""
    seconds = []
    for _ in range(runs):
        if before is not None:
            before()
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        seconds.append(time.perf_counter() - started)
    return seconds


def worker(rank: int, world: int, port: int, args, queue) -> None:
    cuda = torch.cuda.device_count() >= 2
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    shapes = model_like_shapes(int(args.gib * 1024**3), args.tensors)
    if rank == 0:
        _send_side(shapes, device, cuda, args.runs)
    else:
        queue.put(_receive_side(device, cuda, args.runs))
        dist.barrier()
    dist.destroy_process_group()
    if cuda:  # skip interpreter teardown: freeing IPC-shared blocks then aborts with "driver shutting down"
        torch.cuda.synchronize(device)
        os._exit(0)


def _send_side(shapes, device: torch.device, cuda: bool, runs: int) -> None:
    """GPU 0's process: the reference checksums, `runs` + 1 NCCL sends, then (on CUDA) IPC handles
    to its regions, held until the receiver has let go of them."""
    object_device = device if cuda else None
    layout, regions = pack(make_tensors(shapes, device))
    reference = {n: region_checksum(t.contiguous()) for n, t in unpack(layout, regions).items()}
    dist.send_object_list([reference], dst=1, device=object_device)
    for _ in range(runs + 1):  # one unmeasured warm-up transfer
        send_weights(layout, regions, dst=1)
    if cuda:  # same node: the receiver copies straight from our regions over NVLink
        dist.send_object_list(
            [layout, ipc_handles(regions), checksums(regions)], dst=1, device=object_device
        )
    dist.barrier()  # the receiver has let go of our regions
    del regions
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.ipc_collect()


def _receive_side(device: torch.device, cuda: bool, runs: int) -> dict:
    """GPU 1's process: the timed receives, checksum passes and (on CUDA) IPC copies, and whether
    what arrived is bit-identical to the sender's tensors."""
    object_device = device if cuda else None
    holder: list = [None]
    dist.recv_object_list(holder, src=0, device=object_device)
    reference = holder[0]
    received = {}

    def receive() -> None:
        layout, regions = recv_weights(src=0, device=device)
        received.update(layout=layout, regions=regions)

    receive()
    result = {"ours_nccl_s": timed(receive, device, runs)}
    result["verify_s"] = timed(lambda: checksums(received["regions"]), device, runs)
    words = {d: r.view(torch.int32) for d, r in received["regions"].items()}
    result["verify_torch_s"] = timed(
        lambda: [checksum_torch(w) for w in words.values()], device, runs
    )
    checksum_agrees = checksums(received["regions"]) == {d: checksum_torch(w) for d, w in words.items()}
    tensors = unpack(received["layout"], received["regions"])
    identical = all(region_checksum(t.contiguous()) == reference[n] for n, t in tensors.items())
    if cuda:
        shared: list = [None, None, None]
        dist.recv_object_list(shared, src=0, device=object_device)
        layout, handles, expected = shared
        fetch_ipc(handles, expected, device)  # warm-up: opens the handles
        result["ours_ipc_s"] = timed(lambda: fetch_ipc(handles, expected, device), device, runs)
        copied = fetch_ipc(handles, expected, device)
        identical = identical and all(
            region_checksum(t.contiguous()) == reference[n] for n, t in unpack(layout, copied).items()
        )
        del copied
        peer_gpu = torch.device("cuda:0")
        fetch_ipc(handles, expected, peer_gpu)
        result["ipc_same_gpu_s"] = timed(
            lambda: fetch_ipc(handles, expected, peer_gpu), peer_gpu, runs
        )
        del handles
        torch.cuda.synchronize(device)
        torch.cuda.ipc_collect()
    return {**result, "bytes": received["layout"].nbytes, "tensors": len(tensors),
            "bit_identical": identical, "checksum_agrees": checksum_agrees}


def single_process_paths(args, nbytes: int) -> dict:
    cuda = torch.cuda.device_count() >= 2
    src = torch.device("cuda:0") if cuda else torch.device("cpu")
    dst = torch.device("cuda:1") if cuda else torch.device("cpu")
    flat = torch.empty(nbytes, dtype=torch.uint8, device=src)
    results = {"link_copy_s": timed(lambda: flat.to(dst), dst, args.runs)}
    results["device_copy_s"] = timed(lambda: flat.clone(), src, args.runs)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    results["pinned_h2d_s"] = timed(lambda: pinned.to(dst, non_blocking=True), dst, args.runs)
    from engine.checkpoint import read_from_disk

    with tempfile.TemporaryDirectory(dir=args.scratch) as folder:
        write_checkpoint(Path(folder), args.gib, args.tensors)

        def disk_to_gpu() -> None:
            weights = read_from_disk(Path(folder), threads=args.threads)
            torch.frombuffer(weights.buffer, dtype=torch.uint8).to(dst)
            weights.close()

        results["disk_to_gpu_s"] = timed(disk_to_gpu, dst, args.runs)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--tensors", type=int, default=290)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--scratch", default=None, help="folder for the safetensors files")
    parser.add_argument("--out", type=Path, default=Path("results/d2d_weights.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (device README)
    queue = mp.get_context("spawn").SimpleQueue()
    port = 29500 + os.getpid() % 1000
    mp.start_processes(worker, args=(2, port, args, queue), nprocs=2, join=True, start_method="spawn")
    transfer = queue.get()
    paths = single_process_paths(args, transfer["bytes"])
    paths.update({k: v for k, v in transfer.items() if k.endswith("_s")})
    gib = transfer["bytes"] / 1024**3
    rows = {name.removesuffix("_s"): statistics.median(v) for name, v in paths.items()}
    ceilings = {name: "device_copy" if name in SAME_GPU else "link_copy" for name in rows}
    print(f"\n{transfer['tensors']} tensors, {gib:.2f} GiB, medians of {args.runs} runs, "
          f"bit-identical: {transfer['bit_identical']}, kernel checksum = torch checksum: "
          f"{transfer['checksum_agrees']}")
    print(f"{'path':14s} {'seconds':>9s} {'GiB/s':>8s} {'vs ceiling':>11s}  ceiling")
    for name, seconds in rows.items():
        ratio = rows[ceilings[name]] / seconds
        print(f"{name:14s} {seconds:9.4f} {gib / seconds:8.1f} {ratio:11.2f}  {ceilings[name]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gib": gib, "tensors": transfer["tensors"], "runs": args.runs,
                                    "bit_identical": transfer["bit_identical"], "median_s": rows,
                                    "checksum_agrees": transfer["checksum_agrees"], "ceilings": ceilings,
                                    "samples_s": paths, "cuda_devices": torch.cuda.device_count()}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
