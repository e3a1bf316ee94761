"""compresskit._mem: freed heap memory goes back to the OS between stages (glibc)."""

import platform

import pytest

from compresskit import _mem


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_finds_glibc_malloc_trim_and_returns_freed_pages():
    assert _mem._malloc_trim() is not None
    # 64 KiB blocks (below the mmap threshold, so they live on the heap), every other one
    # freed: holes inside the heap, which free() keeps and malloc_trim hands back.
    blocks = [bytearray(65536) for _ in range(1000)]
    del blocks[::2]
    assert _mem.trim() is True
    del blocks


def test_trim_is_a_bool_everywhere(monkeypatch):
    monkeypatch.setattr(_mem, "_malloc_trim", lambda: None)  # another C library
    assert _mem.trim() is False
