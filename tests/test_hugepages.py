"""_foundation/hugepages.advise: the buffer is the same tensor with the same contents, and on Linux with
transparent huge pages in ``madvise`` / ``always`` mode its memory is then backed by huge pages (read back
from /proc/self/smaps, the kernel's own account)."""

import sys
from pathlib import Path

import pytest
import torch

from qkcircuits._foundation import hugepages


def _mappings(ptr: int, n: int):
    """(AnonHugePages kB, VmFlags) of each mapping overlapping [ptr, ptr + n): madvise splits a mapping at the
    advised range's 2 MiB-aligned ends, so a buffer spans several (and the kernel may merge a new one with a
    neighbour)."""
    out, cur = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            try:
                lo, hi = (int(x, 16) for x in head.split("-"))
            except ValueError:
                continue
            cur = [0, ""] if lo < ptr + n and ptr < hi else None
            if cur is not None:
                out.append(cur)
        elif cur is not None and line.startswith("AnonHugePages:"):
            cur[0] = int(line.split()[1])
        elif cur is not None and line.startswith("VmFlags:"):
            cur[1] = line.split(":", 1)[1]
    return out


def _huge_kb(ptr: int, n: int) -> int:
    return sum(kb for kb, _ in _mappings(ptr, n))


def test_advise_keeps_the_tensor_and_small_or_non_cpu_tensors_are_left_alone():
    small = torch.arange(10.0)
    assert hugepages.advise(small) is small and torch.equal(small, torch.arange(10.0))
    big = torch.empty(64 << 18)                              # 64 MiB of float32
    assert hugepages.advise(big) is big
    big.fill_(3.0)
    assert bool((big == 3.0).all())


@pytest.mark.skipif(not sys.platform.startswith("linux") or hugepages._madvise() is None,
                    reason="no transparent huge pages here")
def test_an_advised_buffer_is_backed_by_huge_pages():
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    big = hugepages.advise(torch.empty(64 << 18))
    big.fill_(1.0)                                          # first touch, after the advice
    got = _huge_kb(big.data_ptr(), big.numel() * big.element_size())
    if got == 0 and "[always]" not in mode:
        # the kernel may have no free 2 MiB pages at this moment (fragmented memory): advice, not a promise
        defrag = Path("/sys/kernel/mm/transparent_hugepage/defrag").read_text()
        pytest.skip(f"no huge page granted (enabled: {mode.strip()}; defrag: {defrag.strip()})")
    assert got >= 2048
    if "[madvise]" in mode:                                 # the control: the same buffer, not advised, gets none
        plain = torch.empty(64 << 18)
        plain.fill_(1.0)
        maps = _mappings(plain.data_ptr(), plain.numel() * plain.element_size())
        # where the allocator handed out memory of a mapping advised before (VmFlags "hg": a heap region reused
        # after an earlier advised buffer was freed), that mapping may hold huge pages; no other one may
        assert maps and all(kb == 0 for kb, flags in maps if " hg" not in f" {flags} ")
