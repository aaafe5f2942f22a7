"""The disk path of engine/ (`engine.checkpoint.stream_to_device`) against the machine's limits, on
one GPU (issue 5's goals: >= 90% of the disk's cold read rate, >= 80% of pinned host-to-device
bandwidth when the files are in the page cache).

    python -m loadtest.weight_loader [--gib 8] [--threads 8,16,32] [--runs 3] [--scratch DIR]

Rows, medians of --runs, for a model-like checkpoint of four safetensors shards in --scratch
(a real disk, not tmpfs):
  disk_cold_sequential  - one thread reading each file in 64 MiB pieces, page cache emptied
  disk_cold_parallel_N  - our read pattern (16 MiB positional reads on N threads) into memory
                          that is thrown away, page cache emptied; the disk ceiling is the best
                          of these rows
  stream_cold_N         - stream_to_device on N threads, page cache emptied (vs disk ceiling)
  pinned_h2d            - one copy of the same bytes from pinned host memory (the H2D ceiling)
  pagecache_to_pinned_N - the host half of a warm load: our reads from the page cache into
                          pinned buffers, no device (vs pinned_h2d: can the copy keep up?)
  stream_warm_N         - stream_to_device from the page cache (vs pinned_h2d)
With --chunk-mib A,B the page-cache rows run once per read size (suffix _AMiB).
The page cache is emptied per file with posix_fadvise(DONTNEED) and checked with mincore: each
cold row reports the fraction of the files still resident before it ran.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import tempfile
import threading
from pathlib import Path

import torch

from engine import checkpoint
from engine.checkpoint import _read_chunks, _safetensors_layout, stream_to_device
from loadtest.d2d_weights import timed, write_checkpoint

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
SEQUENTIAL_PIECE = 64 * 1024**2


def resident_fraction(paths: list[Path]) -> float:
    """Fraction of the files' pages in the page cache (mincore over a fresh mapping of each)."""
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        pages = -(-size // mmap.PAGESIZE)
        vector = ctypes.create_string_buffer(pages)
        fd = os.open(path, os.O_RDONLY)
        try:
            address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                if _LIBC.mincore(address, size, vector) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            finally:
                _LIBC.munmap(address, size)
        finally:
            os.close(fd)
        resident += sum(byte & 1 for byte in vector.raw)
        total += pages
    return resident / max(total, 1)


def evict(paths: list[Path]) -> float:
    """Drop the files from the page cache; returns the fraction still resident afterwards."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_fraction(paths)


def read_sequential(paths: list[Path]) -> None:
    piece = bytearray(SEQUENTIAL_PIECE)
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(piece):
                pass


def read_parallel(model_dir: Path, threads: int, pinned: bool = False) -> None:
    """Our loader's read pattern with no device behind it: each thread reuses one buffer (pinned
    host memory, as the loader's slots, if `pinned`)."""
    _, files = _safetensors_layout(model_dir)
    local = threading.local()

    def land(chunk, read_into) -> None:
        if not hasattr(local, "buffer"):
            size = max(checkpoint.READ_CHUNK_BYTES, 32 * 1024**2)
            raw = torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy() if pinned else bytearray(size)
            local.buffer = memoryview(raw)
        read_into(local.buffer[: chunk.nbytes])

    _read_chunks(files, threads, land)


def pinned_h2d(nbytes: int, device: torch.device, runs: int) -> list[float]:
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return timed(lambda: pinned.to(device, non_blocking=True), device, runs)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if not torch.cuda.is_available():
        print("weight_loader measures host-to-device paths: it needs a CUDA GPU")
        return 0
    device = torch.device("cuda:0")
    _report(args, device, *_measure(args, device))
    return 0


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--tensors", type=int, default=290)
    parser.add_argument("--threads", default="8,16,32")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--scratch", default=None, help="folder on the disk to measure")
    parser.add_argument("--warm-only", action="store_true", help="only the page-cache rows")
    parser.add_argument("--chunk-mib", default=str(checkpoint.READ_CHUNK_BYTES // 1024**2),
                        help="read sizes to try in the page-cache rows (MiB, comma-separated)")
    parser.add_argument("--out", type=Path, default=Path("results/weight_loader.json"))
    return parser.parse_args(argv)


def _measure(args: argparse.Namespace, device: torch.device) -> tuple[int, int, dict, dict, float]:
    """Every row's samples on a checkpoint written for the run; returns its bytes and files, the
    seconds by row, what each cold row found resident at most, and what the warm rows found."""
    thread_counts = [int(t) for t in args.threads.split(",")]
    samples: dict[str, list[float]] = {}
    resident_before: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=args.scratch) as folder:
        model_dir = Path(folder)
        write_checkpoint(model_dir, args.gib, args.tensors)
        paths = sorted(model_dir.glob("*.safetensors"))
        nbytes = sum(p.stat().st_size for p in paths)

        def cold(name: str, fn) -> None:
            resident: list[float] = []  # what eviction left in the page cache before each run
            samples[name] = timed(fn, device, args.runs, before=lambda: resident.append(evict(paths)))
            resident_before[name] = max(resident)

        if not args.warm_only:
            cold("disk_cold_sequential", lambda: read_sequential(paths))
            for n in thread_counts:
                cold(f"disk_cold_parallel_{n}", lambda n=n: read_parallel(model_dir, n))
                cold(f"stream_cold_{n}", lambda n=n: stream_to_device(model_dir, device, n))
        samples["pinned_h2d"] = pinned_h2d(nbytes, device, args.runs)
        read_parallel(model_dir, thread_counts[-1])  # into the page cache
        default_chunk = checkpoint.READ_CHUNK_BYTES
        for mib in (int(m) for m in args.chunk_mib.split(",")):
            checkpoint.READ_CHUNK_BYTES = mib * 1024**2
            suffix = "" if checkpoint.READ_CHUNK_BYTES == default_chunk else f"_{mib}MiB"
            for n in thread_counts:
                # the host half alone: page cache -> pinned slots, no device behind it
                samples[f"pagecache_to_pinned_{n}{suffix}"] = timed(
                    lambda n=n: read_parallel(model_dir, n, pinned=True), device, args.runs
                )
                samples[f"stream_warm_{n}{suffix}"] = timed(
                    lambda n=n: stream_to_device(model_dir, device, n), device, args.runs
                )
        checkpoint.READ_CHUNK_BYTES = default_chunk
        return nbytes, len(paths), samples, resident_before, resident_fraction(paths)


def _report(args: argparse.Namespace, device: torch.device, nbytes: int, files: int,
            samples: dict[str, list[float]], resident_before: dict[str, float], resident_warm: float) -> None:
    """Medians against each row's ceiling: a table, and JSON in `--out`."""
    gib = nbytes / 1024**3
    median = {name: statistics.median(v) for name, v in samples.items()}
    disk = min((v for k, v in median.items() if k.startswith("disk_cold")), default=float("nan"))
    ceiling = {k: ("disk" if "cold" in k else "pinned_h2d") for k in median}
    ratio = {k: (disk if ceiling[k] == "disk" else median["pinned_h2d"]) / v for k, v in median.items()}
    print(
        f"\n{gib:.2f} GiB in {files} files, medians of {args.runs} runs; page cache resident "
        f"before cold rows <= {max(resident_before.values(), default=0):.1%}, before warm rows {resident_warm:.1%}"
    )
    print(f"{'path':24s} {'seconds':>8s} {'GiB/s':>7s} {'vs ceiling':>10s}  ceiling")
    for name, seconds in median.items():
        print(f"{name:24s} {seconds:8.3f} {gib / seconds:7.2f} {ratio[name]:10.2f}  {ceiling[name]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gib": gib, "files": files, "runs": args.runs, "median_s": median,
                                    "vs_ceiling": ratio, "ceiling": ceiling, "samples_s": samples,
                                    "resident_before_cold": resident_before, "resident_warm": resident_warm,
                                    "gpu": torch.cuda.get_device_name(device)}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
