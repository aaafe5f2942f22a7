"""Rebuild LMCache 0.5.6's `cuda_ops` against the lent H200's torch 2.11 (vLLM 0.26's).

The PyPI wheel's `cuda_ops` was built against torch 2.13: it does not even load with 2.11 (one
missing libc10 symbol) and, with that symbol supplied, its kernels crash reading tensor sizes
(TensorImpl's layout differs). Built from the sdist's `csrc/` for sm_90 only, ~65 s on the H200's
16 cores. Usage: python3 build_lmcache_cuda_ops.py CSRC_DIR SITE_DIR (SITE_DIR holds `lmcache/`).
"""

import os
import shutil
import sys
import time

os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
os.environ.setdefault("MAX_JOBS", "16")
from torch.utils.cpp_extension import load  # noqa: E402

# The sources of setup_extensions/build_profiles/cuda.py in the LMCache 0.5.6 sdist.
SOURCES = ["pybind.cpp", "mem_kernels.cu", "mp_mem_kernels.cu", "phase_timing_recorder.cu", "blend_kernels.cu",
           "cal_cdf.cu", "ac_enc.cu", "ac_dec.cu", "pos_kernels.cu", "mem_alloc.cpp", "utils.cpp",
           "event_recorder.cpp", "completion_recorder.cpp"]

if __name__ == "__main__":
    csrc, site = sys.argv[1], sys.argv[2]
    os.makedirs("/tmp/lmbuild", exist_ok=True)
    started = time.time()
    load(name="cuda_ops", sources=[f"{csrc}/cuda/{name}" for name in SOURCES], extra_include_paths=[csrc],
         extra_cflags=["-O3"], extra_cuda_cflags=["-O3", "--threads=2"], build_directory="/tmp/lmbuild",
         is_python_module=True)
    dest = os.path.join(site, "lmcache", "cuda_ops.cpython-312-x86_64-linux-gnu.so")
    shutil.copy("/tmp/lmbuild/cuda_ops.so", dest)
    print(f"cuda_ops rebuilt against the local torch in {time.time() - started:.0f} s -> {dest}")
