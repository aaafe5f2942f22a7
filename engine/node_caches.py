"""A node's start caches, from a warm peer: what an engine's first start on a node writes to disk
and every later start there reuses (vLLM's torch.compile cache, with Inductor's and Triton's
artifacts of the compile, and startup plans under VLLM_CACHE_ROOT; Triton's kernels compiled
outside a compile; CUDA's JIT cache), so that a node that never ran the model starts like one
that did.

Files travel under their own relative paths, which carry their owners' keys (vLLM's config and
plan fingerprints, Triton's kernel hashes with the GPU target): an entry that does not fit the new
node is never read by vLLM or Triton, and a peer offers its caches only to a node of the same GPU
type and versions (`CacheKey`). Each file is checked against its digest where it lands, written
next to what is there and never over it, and only under its cache's own folder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath

log = logging.getLogger(__name__)

CACHES: dict[str, tuple[str, str]] = {
    "vllm": ("VLLM_CACHE_ROOT", "~/.cache/vllm"),
    "triton": ("TRITON_CACHE_DIR", "~/.triton/cache"),
    "cuda": ("CUDA_CACHE_PATH", "~/.nv/ComputeCache"),
}
"""Each cache: the variable that moves it and where its owner keeps it without. Not Inductor's
own default folder: vLLM points Inductor into its cache when it compiles (compilation/
compiler_interface.py), and the default collects every other program's compiles."""

MAX_BYTES = 4 << 30
"""At most this much is offered at once: caches grow with every configuration a node ever ran."""


@dataclass(frozen=True)
class CacheKey:
    """What must match for a peer's caches to be any use: the GPU type and the versions whose
    builds the files are."""

    device: str
    vllm: str
    torch: str
    triton: str

    @classmethod
    def here(cls) -> CacheKey:
        return cls(device=_device_name(), vllm=_version("vllm"), torch=_version("torch"),
                   triton=_version("triton"))


@dataclass(frozen=True)
class CacheFile:
    cache: str
    """One of CACHES."""
    path: str
    """Relative to the cache's folder, with '/' between parts."""
    sha256: str
    data: bytes


@dataclass(frozen=True)
class CacheManifest:
    """What a node asking for caches has already: its key and the (cache, path) of every file."""

    key: CacheKey
    files: frozenset[tuple[str, str]]


@dataclass(frozen=True)
class NodeCaches:
    """Files a peer offers, with the key of the node they were made on."""

    key: CacheKey
    files: tuple[CacheFile, ...]

    @property
    def size(self) -> int:
        return sum(len(f.data) for f in self.files)


@dataclass(frozen=True)
class InstalledCaches:
    files: int
    bytes: int
    refused: int
    """Files not written: a digest that did not match, or a path outside its cache."""


def cache_dirs(env: Mapping[str, str]) -> dict[str, Path]:
    """Where each cache lives for a process with environment `env` (an engine's)."""
    return {name: Path(os.path.expanduser(env.get(variable) or default))
            for name, (variable, default) in CACHES.items()}


def manifest(dirs: Mapping[str, Path]) -> CacheManifest:
    return CacheManifest(CacheKey.here(), frozenset((name, path) for name, path, _ in _walk(dirs)))


def export(dirs: Mapping[str, Path], wanted_by: CacheManifest, max_bytes: int = MAX_BYTES) -> NodeCaches | None:
    """This node's cache files that `wanted_by` lacks (None if its key differs: nothing here is of
    use to it), at most `max_bytes` of them, smallest first (plans and kernels before graphs)."""
    key = CacheKey.here()
    if wanted_by.key != key:
        return None
    missing = sorted(((file.stat().st_size, name, path, file) for name, path, file in _walk(dirs)
                      if (name, path) not in wanted_by.files), key=lambda entry: entry[0])
    files, total = [], 0
    for size, name, path, file in missing:
        if total + size > max_bytes:
            break
        try:
            data = file.read_bytes()
        except OSError:  # removed or replaced meanwhile: its owner's business
            continue
        files.append(CacheFile(name, path, hashlib.sha256(data).hexdigest(), data))
        total += len(data)
    return NodeCaches(key, tuple(files))


def install(caches: NodeCaches, dirs: Mapping[str, Path]) -> InstalledCaches:
    """Write `caches`' files that this node lacks into `dirs`; files already here are kept."""
    if caches.key != CacheKey.here():
        log.warning("caches made on %s not installed here (%s)", caches.key, CacheKey.here())
        return InstalledCaches(0, 0, len(caches.files))
    written = size = refused = 0
    for file in caches.files:
        target = _target(dirs, file)
        if target is None or hashlib.sha256(file.data).hexdigest() != file.sha256:
            log.warning("cache file %s/%s refused: outside its cache or not its digest", file.cache, file.path)
            refused += 1
        elif _write_new(target, file.data):
            written, size = written + 1, size + len(file.data)
    return InstalledCaches(written, size, refused)


def _walk(dirs: Mapping[str, Path]):
    """(cache, relative path, file) of every regular file under each cache, links not followed."""
    for name, root in dirs.items():
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [d for d in subfolders if not os.path.islink(os.path.join(folder, d))]
            for file_name in names:
                file = Path(folder, file_name)
                if file.is_file() and not file.is_symlink() and not file_name.startswith(".tmp-caches-"):
                    yield name, file.relative_to(root).as_posix(), file


def _target(dirs: Mapping[str, Path], file: CacheFile) -> Path | None:
    """Where `file` goes, or None unless that is a plain path inside its cache's real folder."""
    root = dirs.get(file.cache)
    relative = PurePosixPath(file.path)
    if root is None or relative.is_absolute() or "\0" in file.path or \
            any(part in ("", ".", "..") for part in file.path.split("/")):
        return None
    target = root.joinpath(*relative.parts)
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(target.parent)]) != real_root:
        return None  # a link on the way leads out of the cache
    return target


def _write_new(target: Path, data: bytes) -> bool:
    """`data` as `target` unless that exists: written aside, then linked in (never replaces)."""
    if target.exists() or target.is_symlink():
        return False
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, aside = tempfile.mkstemp(prefix=".tmp-caches-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.link(aside, target)
        return True
    except FileExistsError:  # another start on this node wrote it meanwhile
        return False
    finally:
        os.unlink(aside)


def _device_name() -> str:
    """The first visible GPU's name through NVML (no CUDA context in this process), else 'cpu'."""
    try:
        import pynvml
    except ImportError:
        return "cpu"
    try:
        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        handle = (pynvml.nvmlDeviceGetHandleByIndex(int(visible)) if visible.isdigit()
                  else pynvml.nvmlDeviceGetHandleByUUID(visible))
        return str(pynvml.nvmlDeviceGetName(handle))
    except pynvml.NVMLError:
        return "cpu"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""
