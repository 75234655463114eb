"""admin_ds/inference/allocator.py: glibc malloc's thresholds for decoding.

Whether they took effect is read back from malloc itself (mallinfo2: bytes in mmapped blocks) in a
fresh process, since they are process-wide."""

import ctypes
import ctypes.util
import os
import subprocess
import sys

import pytest

from admin_ds.inference import allocator

_CHILD = r"""
import ctypes, ctypes.util, sys
from admin_ds.inference.allocator import tune_malloc_for_decoding

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
tuned = tune_malloc_for_decoding()
block = libc.malloc(16 << 20)
mapped = libc.mallinfo2().hblkhd  # bytes in blocks malloc obtained with mmap
libc.free(block)
print(int(tuned), int(mapped >= 16 << 20))
"""


def _glibc_with_mallinfo2() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallinfo2")
    except OSError:
        return False


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
@pytest.mark.parametrize("setting,want", [("1", "1 0"), ("0", "0 1"), ("", "1 0")])
def test_a_16_MiB_block_comes_from_the_heap_once_tuned(setting, want):
    """glibc's default mmap threshold starts at 128 KiB: a 16 MiB block is a mapping of its own,
    unmapped when freed; tuned (the default), it comes from the heap."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env["ADMIN_DS_TUNE_MALLOC"] = setting
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == want.split()


def test_tuning_is_left_to_the_user_where_they_chose(monkeypatch):
    for name in ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "ADMIN_DS_TUNE_MALLOC"):
        monkeypatch.delenv(name, raising=False)
    assert allocator._wanted()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0")
    assert allocator._wanted()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000000")
    assert not allocator._wanted()
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    assert not allocator._wanted()
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv("ADMIN_DS_TUNE_MALLOC", "0")
    assert not allocator._wanted() and not allocator.tune_malloc_for_decoding()
    monkeypatch.setenv("ADMIN_DS_TUNE_MALLOC", "yes")
    with pytest.raises(ValueError, match="ADMIN_DS_TUNE_MALLOC='yes'"):
        allocator.tune_malloc_for_decoding()
