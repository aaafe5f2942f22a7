"""`engine.device_checksum.region_checksum` as one Triton kernel: a single read of the region's bytes
(the torch version makes three passes and writes an intermediate), so verifying a transfer costs
a few milliseconds of HBM bandwidth instead of a third of the transfer. Imported only for CUDA
tensors where Triton is installed; the result is bit-equal to the torch version (integer sums
wrap the same way in any order), which tests/unit/test_device_weights.py checks on a GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_WORDS = 8192


@triton.jit
def _partial_sums(words, n, plain_out, weighted_out, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                  MODULUS: tl.constexpr):
    program = tl.program_id(0).to(tl.int64)
    offsets = program * BLOCK + tl.arange(0, BLOCK)
    word = tl.load(words + offsets, mask=offsets < n, other=0)
    position = ((offsets & (CHUNK - 1)) % MODULUS + 1).to(tl.int32)
    chunk_factor = (program * BLOCK) // CHUNK + 1  # a block never straddles two chunks
    tl.store(plain_out + program, tl.sum(word.to(tl.int64), axis=0))
    tl.store(weighted_out + program, tl.sum((word * position).to(tl.int64), axis=0) * chunk_factor)


def checksum(words: torch.Tensor, chunk_words: int, modulus: int) -> tuple[int, int]:
    """(plain, weighted) of an int32 CUDA tensor, as `device_checksum.checksum_torch` defines them."""
    assert chunk_words % _BLOCK_WORDS == 0 and chunk_words & (chunk_words - 1) == 0
    blocks = max(1, -(-words.numel() // _BLOCK_WORDS))
    partials = torch.empty((2, blocks), dtype=torch.int64, device=words.device)
    with torch.cuda.device(words.device):  # Triton launches on the current device
        _partial_sums[(blocks,)](words, words.numel(), partials[0], partials[1], BLOCK=_BLOCK_WORDS,
                                 CHUNK=chunk_words, MODULUS=modulus, num_warps=8)
    plain, weighted = partials.sum(dim=1).tolist()
    return plain, weighted
