"""A checksum of a tensor's bytes computed on its own device (a GPU's, without a copy to the host):
how an engine verifies weights another engine's GPU handed it over CUDA IPC
(engine/worker_extension.py) against the sender's checksums."""

from __future__ import annotations

import importlib.util

import torch

_WORD = torch.int32
_CHECKSUM_CHUNK_WORDS = 1 << 24
_MODULUS = 65521



def region_checksum(region: torch.Tensor) -> tuple[int, int]:
    """Sum of the region's 32-bit words and their position-weighted sum (a Fletcher-style pair:
    catches flipped, lost and reordered words), on the region's device, in 32-bit products and
    64-bit sums that wrap identically on every device and in any order. On CUDA one Triton
    kernel reads the bytes once (`engine.checksum_cuda`); elsewhere torch does it in passes."""
    raw = region.reshape(-1).view(torch.uint8)
    if raw.numel() % 4:  # only whole words: pad a copy (regions from `pack` never need it)
        raw = torch.cat([raw, raw.new_zeros(4 - raw.numel() % 4)])
    words = raw.view(_WORD)
    if words.is_cuda and importlib.util.find_spec("triton") is not None:
        from engine.checksum_cuda import checksum

        return checksum(words, _CHECKSUM_CHUNK_WORDS, _MODULUS)
    return checksum_torch(words)


def checksum_torch(words: torch.Tensor) -> tuple[int, int]:
    """`region_checksum` of int32 words with torch operations: the definition the kernel matches."""
    size = min(_CHECKSUM_CHUNK_WORDS, max(words.numel(), 1))
    weights = (torch.arange(size, dtype=_WORD, device=words.device) % _MODULUS) + 1
    plain = words.sum(dtype=torch.int64)
    weighted = torch.zeros((), dtype=torch.int64, device=words.device)
    for index, start in enumerate(range(0, words.numel(), size)):
        chunk = words[start : start + size]
        weighted += (index + 1) * (chunk * weights[: chunk.numel()]).sum(dtype=torch.int64)
    return int(plain), int(weighted)
