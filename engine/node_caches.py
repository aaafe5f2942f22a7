"""A node's start caches, from a warm peer: what an engine's first start on a node writes to disk
and every later start there reuses (under VLLM_CACHE_ROOT: vLLM's torch.compile cache, with the
Inductor and Triton artifacts of its compile, its startup plans, and its model registry's
inspection of each model class, which otherwise imports the model in a subprocess: 7 s of a CPU
engine's start here; Triton's kernels compiled outside a compile), so that a node that never ran
the model starts like one that did.

They travel in units, each one folder or file that its owner writes whole and names by its key
(a compile's config hash, a plan's fingerprint with the device and versions, a Triton kernel's
hash with its GPU target; a model class's inspection holds its module's hash): a unit that does
not fit the new node is never read there. Only these
units travel: not vLLM's probe results about the node's own GPUs (its P2P cache), nor anything an
operator put beside them. A peer offers units only to a node of its GPU type and versions
(`CacheKey`), signs what it offers with the cluster's weights key (Triton's launchers are loaded
as code), and a unit lands whole or not at all: staged in the cache, checked against its digests,
then renamed (linked, for a file) into place beside what is there, never over it.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import hmac
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath

from engine.weights import sign

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheSpec:
    variable: str
    """The environment variable that moves the cache."""
    units: tuple[str, ...]
    """Patterns of its units' paths, most specific first."""

    def unit_of(self, path: str) -> str | None:
        """The unit a file at `path` (relative to the cache) belongs to; None: not one we ship."""
        parts = path.split("/")
        for pattern in self.units:
            depth = pattern.count("/") + 1
            candidate = "/".join(parts[:depth])
            if len(parts) >= depth and fnmatch.fnmatchcase(candidate, pattern):
                # a folder that holds units of a more specific pattern is not one itself
                deeper = any(fnmatch.fnmatchcase(candidate, other.rsplit("/", 1)[0])
                             for other in self.units if other.count("/") >= depth)
                return None if deeper else candidate
        return None

    def is_unit(self, name: str, single_file: bool) -> bool:
        """Whether `name` is a whole unit: a file unit, or a folder whose files are its own."""
        return self.unit_of(name if single_file else f"{name}/file") == name


CACHES: dict[str, CacheSpec] = {
    "vllm": CacheSpec("VLLM_CACHE_ROOT", ("torch_compile_cache/torch_aot_compile/*", "torch_compile_cache/*",
                                          "startup_plan/startup_plan_*.json", "modelinfos/*.json")),
    "triton": CacheSpec("TRITON_CACHE_DIR", ("*",)),
}
STAGING_PREFIX = ".tmp-caches-"
MAX_BYTES = 1 << 30
"""At most this much is offered at once (read into the peer's memory, then sent)."""


@dataclass(frozen=True)
class CacheKey:
    """What must match for a peer's caches to be any use: the GPU type and the builds' versions."""

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
    path: str
    """Relative to its unit, '/' between parts; '' when the unit is this one file."""
    sha256: str
    data: bytes


@dataclass(frozen=True)
class CacheUnit:
    cache: str
    """One of CACHES."""
    name: str
    """Relative to the cache's folder."""
    files: tuple[CacheFile, ...]


@dataclass(frozen=True)
class CacheManifest:
    """What a node asking for caches has: its key and the (cache, unit) of each unit."""

    key: CacheKey
    units: frozenset[tuple[str, str]]


@dataclass(frozen=True)
class NodeCaches:
    """Units a peer offers, with the key of its node, signed."""

    key: CacheKey
    units: tuple[CacheUnit, ...]
    signature: str = ""

    def signed(self, weights_key: str) -> NodeCaches:
        return NodeCaches(self.key, self.units, sign(weights_key, self._described()))

    def signed_by(self, weights_key: str) -> bool:
        return bool(self.signature) and hmac.compare_digest(self.signature, sign(weights_key, self._described()))

    def _described(self) -> dict:
        return {"key": asdict(self.key), "units": [[u.cache, u.name, [[f.path, f.sha256] for f in u.files]]
                                                   for u in self.units]}


@dataclass(frozen=True)
class InstalledCaches:
    units: int
    bytes: int
    refused: int
    """Units not installed: not signed by the cluster, a bad path or digest, or a write that failed."""


def cache_dirs(env: Mapping[str, str]) -> dict[str, Path]:
    """Where each cache lives for a process with environment `env` (an engine's), with its
    owner's defaults (vllm/envs.py, triton/knobs.py)."""
    home = Path(os.path.expanduser("~"))
    defaults = {"vllm": Path(env.get("XDG_CACHE_HOME") or home / ".cache") / "vllm",
                "triton": Path(env.get("TRITON_HOME") or home) / ".triton" / "cache"}
    return {name: Path(os.path.expanduser(env[spec.variable])) if env.get(spec.variable) else defaults[name]
            for name, spec in CACHES.items()}


def manifest(dirs: Mapping[str, Path]) -> CacheManifest:
    return CacheManifest(CacheKey.here(), frozenset((cache, unit) for cache, unit, _ in _units(dirs)))


def export(dirs: Mapping[str, Path], wanted_by: CacheManifest, weights_key: str, max_bytes: int = MAX_BYTES,
           min_age_s: float = 30.0) -> NodeCaches | None:
    """This node's units that `wanted_by` lacks, whole, at most `max_bytes` of them, signed; None if
    its key differs (nothing here is of use to it). A unit changed within `min_age_s` (being
    written: an engine compiling) or one that cannot be read whole is left out."""
    key = CacheKey.here()
    if wanted_by.key != key:
        return None
    units, budget = [], max_bytes
    settled = time.time() - min_age_s
    missing = [(cache, name, files) for cache, name, files in _units(dirs) if (cache, name) not in wanted_by.units]
    # newest first: what the engines here ran last is what a new node most likely starts
    for cache, name, files in sorted(missing, key=lambda unit: -_newest(dirs[unit[0]], unit[2])):
        unit = _read_unit(dirs[cache], cache, name, files, budget, settled)
        if unit is not None:
            units.append(unit)
            budget -= sum(len(f.data) for f in unit.files)
    return NodeCaches(key, tuple(units)).signed(weights_key)


def install(caches: NodeCaches, dirs: Mapping[str, Path], weights_key: str) -> InstalledCaches:
    """Put each of `caches`' units that this node lacks into place, whole; keep what is here."""
    if caches.key != CacheKey.here() or not caches.signed_by(weights_key):
        log.warning("caches not installed: not signed with the cluster's key, or made on %s (here %s)",
                    caches.key, CacheKey.here())
        return InstalledCaches(0, 0, len(caches.units))
    installed = size = refused = 0
    for root in set(dirs.values()):
        _remove_stale_staging(root)
    for unit in caches.units:
        try:
            if _install_unit(dirs[unit.cache], unit):
                installed, size = installed + 1, size + sum(len(f.data) for f in unit.files)
        except (KeyError, OSError, ValueError) as exc:
            log.warning("cache unit %s/%s refused: %s", unit.cache, unit.name, exc)
            refused += 1
    return InstalledCaches(installed, size, refused)


def _units(dirs: Mapping[str, Path]) -> Iterator[tuple[str, str, list[str]]]:
    """(cache, unit, its files' paths relative to the cache) of each unit here; links and
    folders of other filesystems are not followed, staging folders not listed."""
    for cache, root in dirs.items():
        units: dict[str, list[str]] = {}
        device = root.stat().st_dev if root.is_dir() else None
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = [d for d in subfolders if _followed(Path(folder, d), device)]
            for file_name in names:
                path = Path(folder, file_name).relative_to(root).as_posix()
                unit = CACHES[cache].unit_of(path)
                if unit is not None:
                    units.setdefault(unit, []).append(path)
        for unit, paths in units.items():
            yield cache, unit, paths


def _followed(folder: Path, device: int | None) -> bool:
    try:
        status = folder.lstat()
    except OSError:  # removed meanwhile
        return False
    return (not folder.name.startswith(STAGING_PREFIX) and stat.S_ISDIR(status.st_mode)
            and status.st_dev == device)


def _newest(root: Path, paths: list[str]) -> float:
    times = []
    for path in paths:
        try:
            times.append((root / path).lstat().st_mtime)
        except OSError:
            pass
    return max(times, default=0.0)


def _read_unit(root: Path, cache: str, name: str, paths: list[str], budget: int, settled: float) -> CacheUnit | None:
    files = []
    for path in paths:
        data = _read_regular(root / path, budget, settled)
        if data is None:
            return None
        budget -= len(data)
        relative = path[len(name) + 1:] if path != name else ""
        files.append(CacheFile(relative, hashlib.sha256(data).hexdigest(), data))
    return CacheUnit(cache, name, tuple(files))


def _read_regular(path: Path, limit: int, settled: float) -> bytes | None:
    """`path`'s bytes if it is a regular file (not a link, FIFO or device), at most `limit` of them
    and older than `settled`; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as file:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode) or status.st_size > limit or status.st_mtime > settled:
                return None
            data = file.read(limit + 1)
    except OSError:
        return None
    return data if len(data) <= limit else None


def _parts(path: str, may_be_empty: bool = False) -> list[str]:
    """`path`'s parts, refused unless a plain relative path."""
    if path == "" and may_be_empty:
        return []
    parts = path.split("/")
    if PurePosixPath(path).is_absolute() or "\0" in path or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"not a plain relative path: {path!r}")
    return parts


def _install_unit(root: Path, unit: CacheUnit) -> bool:
    """Stage `unit` in `root`, check it, then move it into place unless something is there."""
    name = _parts(unit.name)
    single = [f.path for f in unit.files] == [""]
    if not CACHES[unit.cache].is_unit(unit.name, single) or not unit.files:
        raise ValueError("not a unit of its cache")
    for file in unit.files:
        if hashlib.sha256(file.data).hexdigest() != file.sha256:
            raise ValueError(f"{file.path!r} is not its digest")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.ExitStack() as cleanup:
        staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=root)
        cleanup.callback(shutil.rmtree, staging, ignore_errors=True)
        staging_fd = _opened(cleanup, os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW))
        for file in unit.files:
            parts = ["unit", *_parts(file.path, may_be_empty=single)]
            folder = _opened(cleanup, _folder(staging_fd, parts[:-1]))
            out = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=folder)
            with os.fdopen(out, "wb") as target:
                target.write(file.data)
                os.fsync(target.fileno())  # whole on disk before it is in place: never read half after a crash
        root_fd = _opened(cleanup, os.open(root, os.O_RDONLY | os.O_DIRECTORY))
        parent = _opened(cleanup, _folder(root_fd, name[:-1]))
        try:
            if single:  # a link is never made over an existing name
                os.link("unit", name[-1], src_dir_fd=staging_fd, dst_dir_fd=parent, follow_symlinks=False)
            else:  # made empty here first: a folder someone else made, even empty, is theirs
                os.mkdir(name[-1], mode=0o700, dir_fd=parent)
                os.rename("unit", name[-1], src_dir_fd=staging_fd, dst_dir_fd=parent)
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno == errno.ENOTEMPTY:  # someone wrote into it meanwhile: theirs
                return False
            raise
        os.fsync(parent)
        return True


def _opened(cleanup: contextlib.ExitStack, fd: int) -> int:
    cleanup.callback(os.close, fd)
    return fd


def _folder(base_fd: int, parts: list[str]) -> int:
    """An open descriptor of `parts` under `base_fd`, made where missing; no link followed."""
    fd = os.dup(base_fd)
    for part in parts:
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, mode=0o700, dir_fd=fd)
            child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        finally:
            os.close(fd)
        fd = child
    return fd


def _remove_stale_staging(root: Path, older_than_s: float = 3600.0) -> None:
    """Staging folders an install killed midway left (a live one is minutes old at most)."""
    for entry in root.glob(f"{STAGING_PREFIX}*"):
        try:
            if entry.lstat().st_mtime < time.time() - older_than_s and not entry.is_symlink():
                shutil.rmtree(entry)
        except OSError:
            pass


def _device_name() -> str:
    """The first visible GPU's name through NVML (no CUDA context in this process), else 'cpu'."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - not installed, or NVMLError: no driver, no GPU
        return "cpu"
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        handle = (pynvml.nvmlDeviceGetHandleByIndex(int(visible)) if visible.isdigit()
                  else pynvml.nvmlDeviceGetHandleByUUID(visible))
        return str(pynvml.nvmlDeviceGetName(handle))
    except Exception:  # noqa: BLE001 - NVMLError: an index or UUID NVML does not know
        return "unknown GPU"
    finally:
        pynvml.nvmlShutdown()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""
