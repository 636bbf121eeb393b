"""tfm: train and run Transformer translation models from the command line."""

import os as _os

__version__ = "0.1.0"

# oneDNN, torch's CPU backend for bf16 matmuls, JIT-compiles a kernel for every matmul shape and
# caches 1,024 of them. Token-bucketed batches have ~100 shapes (Multi30k), each with ~57 distinct
# matmuls forward and backward, so with the default the cache thrashes: kernels are recompiled
# and their code buffers mapped and unmapped at every step (strace: ~60 mmap/munmap pairs per step,
# ~1,000 page faults). With room for 16,384 the second epoch compiles nothing (faster training:
# docs/performance.md). Read once, when oneDNN first runs, so it is set on import; a user's
# own ONEDNN_PRIMITIVE_CACHE_CAPACITY wins.
# `tfm train` keeps fewer (runtime/cpu.py, TRAINING_KERNEL_CACHE): there every batch brings new shapes.
ONEDNN_PRIMITIVE_CACHE_CAPACITY = 16384
# The environment as the user started this process with, before the line below changes it: what a
# process that tfm starts again in its place must see (runtime/allocator.py).
LAUNCH_ENVIRONMENT = dict(_os.environ)
USER_KERNEL_CACHE = _os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
_os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE_CAPACITY))
