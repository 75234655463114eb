"""glibc malloc's thresholds for decoding on a CPU: freed memory is kept for the next step and batch.

Decoding allocates and frees tensors of the same few sizes at every step and every batch: logits
and log-probabilities (rows x vocabulary), a search's key/value caches, each 1-30 MiB. glibc's
malloc serves blocks above its mmap threshold with their own mappings, unmapped when freed, and
hands the top of its heap back to the system once more than its trim threshold is free there. A
block obtained again then starts as fresh pages that the kernel faults in and zeroes one by one.
The defaults adapt (the mmap threshold rises towards 32 MiB as such blocks are freed, the trim
threshold with it) but keep returning memory that the next batch asks for again. Fixing the mmap
threshold at 32 MiB and the trim threshold at 1 GiB keeps it: the Multi30k test set translated
with beam 4 in 0.89x the time, greedy 0.94x, the same translations, at ~10% more peak memory
(BENCHMARKS.md, ``bench/malloc.py``). Setting only the trim threshold is slower than the defaults:
it stops the mmap threshold's adaptation at 128 KiB.

translate.py and back-translation call ``tune_malloc_for_decoding()`` before they decode on a CPU.
It leaves malloc alone when ADMIN_DS_TUNE_MALLOC=0, when the environment already sets glibc's
malloc tunables (MALLOC_*_ variables, GLIBC_TUNABLES with glibc.malloc), and where the C library is
not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["tune_malloc_for_decoding"]

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit systems
TRIM_THRESHOLD = 1 << 30

_USER_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                  "MALLOC_ARENA_MAX")


def _wanted() -> bool:
    value = os.environ.get("ADMIN_DS_TUNE_MALLOC", "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"ADMIN_DS_TUNE_MALLOC={value!r}: use 1 (the default) or 0 (leave malloc's "
                         f"thresholds as they are)")
    if value == "0" or any(name in os.environ for name in _USER_TUNABLES):
        return False
    return "glibc.malloc" not in os.environ.get("GLIBC_TUNABLES", "")


def tune_malloc_for_decoding() -> bool:
    """Set glibc malloc's mmap and trim thresholds for decoding (process-wide; see the module's
    docstring). True if they were set."""
    if not _wanted():
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt, _ = libc.mallopt, libc.gnu_get_libc_version
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS) or no C library found
        return False
    # mallopt returns 1 on success; the mmap threshold first, so its adaptation never meets a
    # fixed trim threshold alone.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
