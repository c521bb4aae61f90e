"""The MRV2-style peer (``tests-integration/peers/mrv2_style.py``) computes the step it times.

A benchmark peer that launched kernels computing the wrong thing would time the wrong
work, so each step's outputs are checked against a plain numpy model of the same workload:
request ``b`` starts with ``CONTEXT + b % PAGE`` cached tokens and decodes one token per
step; a request whose new token opens a page gets the next of its ``page_ids``. Small sizes
(three requests in an eight-row state, eight pages of four tokens) keep Triton's
interpreter quick on CPU.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from kernel_mode import needs_kernels
from peers.mrv2_style import PAD_SLOT, Mrv2StyleStep, time_steps

BS, MAX_BLOCKS, PAGE, MAX_REQS, CONTEXT = 3, 8, 4, 8, 5
#: every request crosses at least two page boundaries
STEPS = 10


def _sampled(position: np.ndarray, row: np.ndarray) -> np.ndarray:
    """The stand-in sampler's token, as the module documents it."""
    return ((position * 7919 + row) % 32000).astype(np.int32)


def test_steps_match_a_numpy_model(device: str) -> None:
    needs_kernels(device)
    _check_steps(Mrv2StyleStep(BS, MAX_BLOCKS, device, context_len=CONTEXT, page_size=PAGE,
                               max_reqs=MAX_REQS, seed=3))


class _LowArena:
    """Host memory mapped at a fixed address below 4 GiB (anonymous, zeroed), handing out
    tensors as the peer's staging allocator does: where an allocator puts small buffers
    is the machine's choice (the H200 host gave addresses below 2**32). The mapping is
    never unmapped: tensors over it may outlive the test (1 MiB a case)."""

    def __init__(self, base: int, size: int = 1 << 20) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        self.size = size
        # PROT_READ | PROT_WRITE; MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE
        for hint in range(base, base + (64 << 20), 1 << 20):
            addr = libc.mmap(hint, size, 3, 0x22 | 0x100000, -1, 0)
            if addr == hint:
                break
            if addr not in (None, ctypes.c_void_p(-1).value):
                libc.munmap(ctypes.c_void_p(addr), size)  # an old kernel's mere hint
        else:
            pytest.skip(f"no free mapping near {base:#x} on this machine")
        self.used = 0
        self.bytes = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(hint))

    def zeros(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        off, self.used = self.used, self.used + -(-nbytes // 64) * 64
        assert self.used <= self.size
        return torch.from_numpy(self.bytes[off:off + nbytes]).view(dtype)


@pytest.mark.parametrize("base", [0x4000_0000, 0xC000_0000], ids=["below-2^31", "below-2^32"])
def test_staging_buffers_at_low_addresses(base: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A UVA address is passed as a Python int, which Triton types by its value: below
    2**31 an int32, below 2**32 a uint32. The kernels widen it before the cast to a pointer
    (the interpreter's cast is a bitcast: a 4-byte value does not view as an 8-byte
    pointer), so the steps are right wherever the host's allocator put the buffers."""
    needs_kernels("cpu")
    arena = _LowArena(base)
    monkeypatch.setattr(Mrv2StyleStep, "_host", lambda self, n, dtype: arena.zeros(n, dtype))
    s = Mrv2StyleStep(BS, MAX_BLOCKS, "cpu", context_len=CONTEXT, page_size=PAGE,
                      max_reqs=MAX_REQS, seed=3)
    assert all(base <= a < 2**32 for sl in s._addrs for a in sl.values())
    _check_steps(s)


def _check_steps(s: Mrv2StyleStep) -> None:
    rows = s.rows.astype(np.int64)
    assert len(set(rows.tolist())) == BS and rows.max() < MAX_REQS
    length = CONTEXT + np.arange(BS) % PAGE  # tokens cached before the step
    appended_any = False
    for k in range(STEPS):
        h2d = s.h2d_copies
        s.step()
        r = s.readback()
        appends = length % PAGE == 0
        appended_any |= bool(appends.any())
        # 2 H2D every step, a third (the diff contents) when some request got a page
        assert s.h2d_copies - h2d == 2 + int(appends.any()), k
        pages = -(-(length + 1) // PAGE)
        np.testing.assert_array_equal(r.rows, rows)
        np.testing.assert_array_equal(r.num_blocks, pages)
        np.testing.assert_array_equal(r.positions, length)
        np.testing.assert_array_equal(r.seq_lens[:BS], length + 1)
        np.testing.assert_array_equal(r.seq_lens[BS:], 0)
        np.testing.assert_array_equal(r.logits_indices, np.arange(BS))
        want_table = np.zeros((BS, MAX_BLOCKS), dtype=np.int32)
        for b in range(BS):
            want_table[b, : pages[b]] = s.page_ids[b, : pages[b]]
            # the gathered row: the persistent row for its length
            np.testing.assert_array_equal(r.block_tables[b, : pages[b]],
                                          s.page_ids[b, : pages[b]])
        # the diffs landed at their start columns, nothing past them
        np.testing.assert_array_equal(r.persistent_rows, want_table)
        page_of_token = s.page_ids[np.arange(BS), length // PAGE].astype(np.int64)
        np.testing.assert_array_equal(r.slot_mapping[:BS], page_of_token * PAGE + length % PAGE)
        np.testing.assert_array_equal(r.slot_mapping[BS:], PAD_SLOT)
        if k > 0:  # the input ids are the tokens the last step sampled
            np.testing.assert_array_equal(r.input_ids, _sampled(length - 1, rows))
        np.testing.assert_array_equal(r.last_sampled, _sampled(length, rows))
        np.testing.assert_array_equal(r.num_computed, length + 1)
        np.testing.assert_array_equal(r.temperature, s.temperature[rows])
        np.testing.assert_array_equal(r.top_p, s.top_p[rows])
        np.testing.assert_array_equal(r.top_k, s.top_k[rows])
        length = length + 1
    assert appended_any
    # rows outside the batch were never written
    others = np.setdiff1d(np.arange(MAX_REQS), rows)
    assert not s.table.cpu().numpy()[others].any()


def test_a_full_table_is_refused(device: str) -> None:
    needs_kernels(device)
    s = Mrv2StyleStep(1, 2, device, context_len=4, page_size=4, max_reqs=2)
    for _ in range(4):  # tokens 4..7 fill page 2 of 2
        s.step()
    with pytest.raises(RuntimeError, match="max_blocks=2"):
        s.step()


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="bs <= max_reqs"):
        Mrv2StyleStep(9, 8, "cpu", page_size=4, max_reqs=8)
    with pytest.raises(ValueError, match="leave room"):
        Mrv2StyleStep(1, 2, "cpu", context_len=8, page_size=4, max_reqs=2)
    with pytest.raises(ValueError, match="do not fit"):
        time_steps(1, 2, steps=10, device="cpu", warmup=0, page_size=4)


def test_time_steps_reports_a_checked_run(device: str) -> None:
    needs_kernels(device)
    got = time_steps(BS, MAX_BLOCKS, steps=4, device=device, warmup=2, page_size=PAGE)
    assert got["gather_ok"] is True
    assert {"host_us_median", "gpu_us_per_step"} <= got.keys()
    # 4 steps of 3 rows with pages of 4: 3 appends, on 3 of the 4 steps
    assert got["h2d_per_step"] == 2 + 3 / 4
    assert got["launches_per_step"] == 4 + 3 / 4
    if device == "cuda":
        torch.cuda.synchronize()
    else:
        assert got["gpu_us_per_step"] is None  # no CUDA events on CPU
