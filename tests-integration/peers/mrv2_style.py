"""vLLM Model Runner V2's per-decode-step metadata path, re-created for a same-run comparison.

Not vLLM's code: written by us from its documented design (the MRV2 design doc
``docs/design/model_runner_v2.md``, the vLLM blog post on MRV2, and the behaviour of
``vllm/v1/worker/gpu/{buffer_utils,block_table,model_runner}.py`` as described in the
project's research notes). What it re-creates, per ordinary decode step:

* GPU-resident request state in fixed ``max_reqs`` rows (``num_computed``, last sampled
  token, the persistent block table); a batch names its rows through ``idx_mapping``;
* block tables as a staged-write tensor: the host stages append-only diffs (row, start
  column, page ids); their descriptors go through a ring of pinned buffers that the apply
  kernel reads in place (UVA), the page ids through a pinned H2D, one kernel applies them;
* two H2D copies every step (``idx_mapping``, ``query_start_loc``), a third only on steps
  where some request crosses a page boundary (the diff contents);
* Triton kernels that build positions and seq_lens, put the last sampled tokens into the
  input ids, gather the batch's block-table rows (row lengths read from a UVA snapshot of
  the host's per-row page counts) and compute the slot mapping from the persistent table;
* sampling parameters as UVA snapshots of host arrays, read by a kernel through
  ``idx_mapping`` (here the token kernel gathers them in batch order, standing in for the
  sampler's reads).

Left out, which only makes this peer cheaper than MRV2: the ``cu_num_logits`` arange and
the zero fills, the per-request Python loop over every scheduled request (only requests
that got a page are visited), and multiple KV-cache groups. A post-step kernel stands in
for the sampler and MRV2's ``post_update`` (advance ``num_computed``, write a token); it is
not metadata publication and stays outside the host timing, as do the scheduler's output
(which requests got a page) and the wait that keeps a ring slot from being rewritten while
a step in flight reads it (MRV2 leaves that bound to the engine).

UVA on both devices: a kernel takes the staging buffer's address as an int and casts it
with ``.to(tl.pointer_type(...))`` (``_uva``: through uint64 first, as a low address
arrives as a 32-bit int). On CUDA the buffers come from torch's pinned allocator
(``cudaHostAlloc``), whose host address is the device address under UVA. Under Triton's
interpreter (``TRITON_INTERPRET=1``, CPU tensors) the int-to-pointer cast is a bitcast and
loads dereference host addresses, so the same int is the host tensor's address; no pinning
there (it needs CUDA) and nothing is copied.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

#: the slot id of a padding token (a graph replays over the padded batch)
PAD_SLOT = -1
#: the staging buffers kernels read in place (the rest travel by H2D copies)
_UVA_READ = ("desc", "num_blocks", "temp", "top_p", "top_k")
#: the stand-in sampler's token: (position * TOKEN_MULT + state row) % VOCAB
TOKEN_MULT, VOCAB = 7919, 32000


@triton.jit
def _uva(addr, dtype: tl.constexpr):  # type: ignore[no-untyped-def]
    """The pointer to ``dtype`` at host address ``addr``, an int argument. Triton types an
    int by its value, and a host address can be low: below 2**31 it arrives as an int32;
    below 2**32 the interpreter keeps it as a 4-byte uint32 though it calls it int64. The
    cast to a pointer is a bitcast there, which cannot view 4 bytes as an 8-byte pointer,
    so the address is first converted to uint64 (a real conversion at every width: never
    a no-op, unlike a cast to the int64 it may claim to be already)."""
    return addr.to(tl.uint64).to(tl.pointer_type(dtype))


@triton.jit
def _apply_staged_writes(  # type: ignore[no-untyped-def]
        table, stride, desc_addr, cap, contents, BLOCK: tl.constexpr):
    """One program per staged write; descriptors (row, start, offset, length) via UVA."""
    w = tl.program_id(0)
    desc = _uva(desc_addr, tl.int32)
    row = tl.load(desc + w).to(tl.int64)
    start = tl.load(desc + cap + w)
    offset = tl.load(desc + 2 * cap + w)
    length = tl.load(desc + 3 * cap + w)
    i = 0
    while i < length:
        o = i + tl.arange(0, BLOCK)
        m = o < length
        tl.store(table + row * stride + start + o, tl.load(contents + offset + o, mask=m), mask=m)
        i += BLOCK


@triton.jit
def _prepare_pos_seq_lens(  # type: ignore[no-untyped-def]
        idx, qsl, num_computed, positions, seq_lens, num_reqs, BLOCK: tl.constexpr):
    """Positions from the GPU's ``num_computed``; padding requests get seq_len 0."""
    b = tl.program_id(0)
    if b < num_reqs:
        row = tl.load(idx + b)
        s = tl.load(qsl + b)
        e = tl.load(qsl + b + 1)
        done = tl.load(num_computed + row)
        i = 0
        while i < e - s:
            o = i + tl.arange(0, BLOCK)
            tl.store(positions + s + o, (done + o).to(tl.int64), mask=o < e - s)
            i += BLOCK
        tl.store(seq_lens + b, done + e - s)
    else:
        tl.store(seq_lens + b, 0)


@triton.jit
def _combine_sampled(  # type: ignore[no-untyped-def]
        idx, qsl, last_sampled, input_ids, logits_indices, temp_addr, top_p_addr, top_k_addr,
        b_temp, b_top_p, b_top_k):
    """Input ids from the last sampled tokens (on the GPU); sampling scalars via UVA."""
    b = tl.program_id(0)
    row = tl.load(idx + b)
    last = tl.load(qsl + b + 1) - 1
    tl.store(input_ids + last, tl.load(last_sampled + row))
    tl.store(logits_indices + b, last)
    tl.store(b_temp + b, tl.load(_uva(temp_addr, tl.float32) + row))
    tl.store(b_top_p + b, tl.load(_uva(top_p_addr, tl.float32) + row))
    tl.store(b_top_k + b, tl.load(_uva(top_k_addr, tl.int32) + row))


@triton.jit
def _gather_block_tables(  # type: ignore[no-untyped-def]
        idx, table, out, stride, num_blocks_addr, BLOCK: tl.constexpr):
    """The batch's rows into the fixed-address input table, as long as the UVA counts say."""
    b = tl.program_id(0)
    row = tl.load(idx + b).to(tl.int64)
    n = tl.load(_uva(num_blocks_addr, tl.int32) + row)
    i = 0
    while i < n:
        o = i + tl.arange(0, BLOCK)
        m = o < n
        tl.store(out + b * stride + o, tl.load(table + row * stride + o, mask=m), mask=m)
        i += BLOCK


@triton.jit
def _compute_slot_mappings(  # type: ignore[no-untyped-def]
        idx, qsl, positions, table, stride, slots, num_reqs, num_tokens, padded_tokens,
        PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """Slots from the persistent table; the last program pads the tail with PAD_SLOT."""
    b = tl.program_id(0)
    if b == num_reqs:
        i = num_tokens
        while i < padded_tokens:
            o = i + tl.arange(0, BLOCK)
            tl.store(slots + o, tl.full((BLOCK,), -1, tl.int64), mask=o < padded_tokens)
            i += BLOCK
    else:
        row = tl.load(idx + b).to(tl.int64)
        s = tl.load(qsl + b)
        e = tl.load(qsl + b + 1)
        i = s
        while i < e:
            o = i + tl.arange(0, BLOCK)
            m = o < e
            p = tl.load(positions + o, mask=m, other=0)
            page = tl.load(table + row * stride + p // PAGE, mask=m, other=0).to(tl.int64)
            tl.store(slots + o, page * PAGE + p % PAGE, mask=m)
            i += BLOCK


@triton.jit
def _post_update(  # type: ignore[no-untyped-def]
        idx, qsl, positions, num_computed, last_sampled, MULT: tl.constexpr,
        VOCAB_SIZE: tl.constexpr):
    """Stand-in for sampling + MRV2's post_update: advance the state, write a token."""
    b = tl.program_id(0)
    row = tl.load(idx + b)
    s = tl.load(qsl + b)
    e = tl.load(qsl + b + 1)
    tl.store(num_computed + row, tl.load(num_computed + row) + e - s)
    token = (tl.load(positions + e - 1) * MULT + row) % VOCAB_SIZE
    tl.store(last_sampled + row, token.to(tl.int32))


@dataclass(frozen=True)
class StepReadback:
    """The last step's device outputs and state for the batch, copied to numpy (batch order)."""

    rows: np.ndarray  # the state row of each batch index (idx_mapping)
    positions: np.ndarray  # [bs] int64
    seq_lens: np.ndarray  # [padded] int32, zero beyond bs
    input_ids: np.ndarray  # [bs] int32
    logits_indices: np.ndarray  # [bs] int32
    slot_mapping: np.ndarray  # [padded] int64, PAD_SLOT beyond bs
    block_tables: np.ndarray  # [bs, max_blocks] gathered rows (stale tails not cleared)
    persistent_rows: np.ndarray  # [bs, max_blocks] the persistent table's rows
    num_blocks: np.ndarray  # [bs] the host's page counts (the UVA snapshot's source)
    num_computed: np.ndarray  # [bs] after the post-step update
    last_sampled: np.ndarray  # [bs] after the post-step update
    temperature: np.ndarray  # [bs] gathered through UVA
    top_p: np.ndarray
    top_k: np.ndarray


class Mrv2StyleStep:
    """``bs`` decode requests in random rows of a ``max_reqs``-row GPU state, one token each
    per step. Row ``b`` starts with ``context_len + b % page_size`` cached tokens, so
    ``1/page_size`` of the rows cross a page boundary (and append one page) each step.

    ``step()`` runs one step; ``last_host_ns`` is the host time of its metadata part (staging,
    snapshots, copies, launches) and ``last_wait_ns`` the untimed wait for its ring slot.
    ``page_ids[b]`` are the pages request ``b`` owns, in order; ``temperature``, ``top_p``
    and ``top_k`` the host's per-state-row sampling arrays (snapshotted every step). ``ring``
    is the depth of the staging ring (MRV2: at least the steps in flight); on CUDA a slot is
    reused only after the event of the step that last used it has completed.
    """

    def __init__(self, bs: int, max_blocks: int, device: torch.device | str, *,
                 context_len: int | None = None, page_size: int = 16, max_reqs: int = 1024,
                 ring: int = 2, seed: int = 0) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if context_len is None:
            context_len = max_blocks * page_size // 2
        if not 1 <= bs <= max_reqs or ring < 1 or page_size < 1:
            raise ValueError(f"need 1 <= bs <= max_reqs, ring >= 1, page_size >= 1; got bs={bs}, "
                             f"max_reqs={max_reqs}, ring={ring}, page_size={page_size}")
        if context_len < 1 or context_len + page_size > max_blocks * page_size:
            raise ValueError(f"context_len {context_len} (+ up to page_size-1 stagger) must "
                             f"leave room in {max_blocks} pages of {page_size}: lower it")
        self.bs, self.max_blocks, self.page, self.max_reqs, self.ring = (
            bs, max_blocks, page_size, max_reqs, ring)
        self.padded = min(-(-bs // 8) * 8, max_reqs)  # a CUDA-graph batch size
        rng = np.random.default_rng(seed)
        self.rows = rng.choice(max_reqs, bs, replace=False).astype(np.int32)
        self.page_ids = rng.permutation(bs * max_blocks).astype(np.int32).reshape(bs, max_blocks)
        self._len = context_len + np.arange(bs, dtype=np.int64) % page_size  # tokens cached
        self._num_blocks = np.zeros(max_reqs, dtype=np.int32)  # host truth, not pinned
        self.temperature = rng.uniform(0.5, 1.5, max_reqs).astype(np.float32)
        self.top_p = rng.uniform(0.8, 1.0, max_reqs).astype(np.float32)
        self.top_k = rng.integers(1, 100, max_reqs).astype(np.int32)
        dev, i32 = self.device, torch.int32
        self.table = torch.zeros(max_reqs, max_blocks, dtype=i32, device=dev)
        self.input_tables = torch.zeros(max_reqs, max_blocks, dtype=i32, device=dev)
        self.num_computed = torch.zeros(max_reqs, dtype=i32, device=dev)
        self.last_sampled = torch.zeros(max_reqs, dtype=i32, device=dev)
        self.idx = torch.zeros(max_reqs, dtype=i32, device=dev)
        self.qsl = torch.zeros(max_reqs + 1, dtype=i32, device=dev)
        self.positions = torch.zeros(max_reqs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(max_reqs, dtype=i32, device=dev)
        self.input_ids = torch.zeros(max_reqs, dtype=i32, device=dev)
        self.logits_indices = torch.zeros(max_reqs, dtype=i32, device=dev)
        self.slots = torch.zeros(max_reqs, dtype=torch.int64, device=dev)
        self.b_temp = torch.zeros(max_reqs, dtype=torch.float32, device=dev)
        self.b_top_p = torch.zeros(max_reqs, dtype=torch.float32, device=dev)
        self.b_top_k = torch.zeros(max_reqs, dtype=i32, device=dev)
        self.contents = torch.zeros(max(max_reqs, 1), dtype=i32, device=dev)
        self._slots = [self._new_slot() for _ in range(ring)]
        # numpy views and UVA addresses made once per buffer, as MRV2's UvaBuffer does
        self._views = [{n: t.numpy() for n, t in sl.items()} for sl in self._slots]
        self._addrs = [{n: self._uva(sl[n]) for n in _UVA_READ} for sl in self._slots]
        self._scheduled = np.ones(bs, dtype=np.int32)  # decode: one token per request
        self._events: list[torch.cuda.Event | None] = [None] * ring
        self._staged: list[tuple[int, int, np.ndarray]] = []
        self.steps = self.h2d_copies = self.launches = 0
        self.last_host_ns = self.last_wait_ns = 0
        self._admit(rng)

    def _host(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, pin_memory=self.cuda)

    def _new_slot(self) -> dict[str, torch.Tensor]:
        m = self.max_reqs
        return {"desc": self._host(4 * m, torch.int32), "contents": self._host(m, torch.int32),
                "num_blocks": self._host(m, torch.int32), "temp": self._host(m, torch.float32),
                "top_p": self._host(m, torch.float32), "top_k": self._host(m, torch.int32),
                "idx": self._host(m, torch.int32), "qsl": self._host(m + 1, torch.int32)}

    def _uva(self, t: torch.Tensor) -> int:
        """The address a kernel reads ``t`` at in place (see the module docstring)."""
        if self.cuda and not t.is_pinned():
            raise RuntimeError("a UVA read needs pinned host memory: allocate with pin_memory")
        return int(t.data_ptr())

    def _admit(self, rng: np.random.Generator) -> None:
        """New requests: their whole rows as overwrite writes (start 0), their counts and
        first tokens; one untimed step's worth of staging, then a sync."""
        for b in range(self.bs):
            self._stage(b, 0, -(-int(self._len[b]) // self.page))
        self._apply(0)
        rows = torch.from_numpy(self.rows.astype(np.int64)).to(self.device)
        self.num_computed[rows] = torch.from_numpy(self._len.astype(np.int32)).to(self.device)
        first = rng.integers(0, VOCAB, self.bs).astype(np.int32)
        self.last_sampled[rows] = torch.from_numpy(first).to(self.device)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.h2d_copies = self.launches = 0

    def _stage(self, b: int, start: int, count: int) -> None:
        """Append-only diff: request ``b``'s next ``count`` pages land at column ``start`` of
        its state row; the host count follows."""
        row = int(self.rows[b])
        if start + count > self.max_blocks:
            raise RuntimeError(f"row {row} would hold {start + count} pages, more than "
                               f"max_blocks={self.max_blocks}: raise max_blocks or step less")
        self._staged.append((row, start, self.page_ids[b, start:start + count]))
        self._num_blocks[row] = start + count

    def _apply(self, k: int) -> None:
        """Staged writes -> descriptors into UVA slot ``k``, page ids by pinned H2D, one
        kernel."""
        n = len(self._staged)
        slot, views = self._slots[k], self._views[k]
        if n == 0:
            return
        if n > self.max_reqs:
            raise RuntimeError(f"{n} staged writes in one step, more than max_reqs")
        lengths = np.fromiter((len(w[2]) for w in self._staged), dtype=np.int32, count=n)
        total = int(lengths.sum())
        if total > slot["contents"].numel():  # grow to a power of two (the slot is idle)
            slot["contents"] = self._host(1 << (total - 1).bit_length(), torch.int32)
            views["contents"] = slot["contents"].numpy()
        if total > self.contents.numel():
            self.contents = torch.zeros(slot["contents"].numel(), dtype=torch.int32,
                                        device=self.device)
        m, desc = self.max_reqs, views["desc"]
        desc[:n] = [w[0] for w in self._staged]
        desc[m:m + n] = [w[1] for w in self._staged]
        desc[3 * m:3 * m + n] = lengths
        desc[2 * m] = 0
        np.cumsum(lengths[:-1], out=desc[2 * m + 1:2 * m + n])
        np.concatenate([w[2] for w in self._staged], out=views["contents"][:total])
        self.contents[:total].copy_(slot["contents"][:total], non_blocking=True)
        _apply_staged_writes[(n,)](self.table, self.max_blocks, self._addrs[k]["desc"], m,
                                   self.contents, BLOCK=128)
        self.h2d_copies += 1
        self.launches += 1
        self._staged.clear()

    def _acquire(self, k: int) -> int:
        """Wait until slot ``k`` is no longer read by an in-flight step; the ns blocked."""
        ev = self._events[k]
        if ev is None or ev.query():
            return 0
        t0 = time.perf_counter_ns()
        ev.synchronize()
        return time.perf_counter_ns() - t0

    def step(self) -> None:
        """One decode step. Timed (``last_host_ns``): the runner's metadata work, from the
        scheduler's output to the last launch. Untimed, as an engine does them elsewhere:
        the scheduler's output (which requests got a page), the wait that bounds the steps in
        flight to the ring (MRV2 leaves it to the engine's sync on sampled tokens; here a
        per-slot event) and the stand-in for sampling and ``post_update``."""
        k = self.steps % self.ring
        self.last_wait_ns = self._acquire(k)
        new_page = np.flatnonzero(self._len % self.page == 0).tolist()
        slot, views, addr = self._slots[k], self._views[k], self._addrs[k]
        bs, padded = self.bs, self.padded
        t0 = time.perf_counter_ns()
        for b in new_page:
            self._stage(b, int(self._num_blocks[self.rows[b]]), 1)
        self._apply(k)
        for name, src in (("num_blocks", self._num_blocks), ("temp", self.temperature),
                          ("top_p", self.top_p), ("top_k", self.top_k)):
            views[name][:] = src  # UvaBackedTensor snapshots: host memcpy, no DMA
        views["idx"][:bs] = self.rows
        self.idx[:bs].copy_(slot["idx"][:bs], non_blocking=True)
        qsl = views["qsl"]
        np.cumsum(self._scheduled, out=qsl[1:bs + 1])
        qsl[bs + 1:] = qsl[bs]  # non-decreasing padding up to max_reqs + 1
        self.qsl.copy_(slot["qsl"], non_blocking=True)
        self.h2d_copies += 2
        _prepare_pos_seq_lens[(padded,)](self.idx, self.qsl, self.num_computed, self.positions,
                                         self.seq_lens, bs, BLOCK=8)
        _combine_sampled[(bs,)](self.idx, self.qsl, self.last_sampled, self.input_ids,
                                self.logits_indices, addr["temp"], addr["top_p"], addr["top_k"],
                                self.b_temp, self.b_top_p, self.b_top_k)
        _gather_block_tables[(bs,)](self.idx, self.table, self.input_tables, self.max_blocks,
                                    addr["num_blocks"], BLOCK=1024)
        _compute_slot_mappings[(bs + 1,)](self.idx, self.qsl, self.positions, self.table,
                                          self.max_blocks, self.slots, bs, bs, padded,
                                          PAGE=self.page, BLOCK=8)
        self.last_host_ns = time.perf_counter_ns() - t0
        self.launches += 4
        if self.cuda:
            ev = self._events[k]
            if ev is None:  # one event per slot, re-recorded whenever the slot is used
                ev = self._events[k] = torch.cuda.Event()
            ev.record()
        _post_update[(bs,)](self.idx, self.qsl, self.positions, self.num_computed,
                            self.last_sampled, MULT=TOKEN_MULT, VOCAB_SIZE=VOCAB)
        self._len += 1
        self.steps += 1

    def readback(self) -> StepReadback:
        """The last step's outputs, for checks (synchronizes)."""
        bs, p, idx = self.bs, self.padded, torch.from_numpy(self.rows.astype(np.int64))

        def host(t: torch.Tensor) -> np.ndarray:
            return t.detach().cpu().numpy().copy()

        dev_idx = idx.to(self.device)
        return StepReadback(
            rows=self.rows.copy(), positions=host(self.positions[:bs]),
            seq_lens=host(self.seq_lens[:p]), input_ids=host(self.input_ids[:bs]),
            logits_indices=host(self.logits_indices[:bs]), slot_mapping=host(self.slots[:p]),
            block_tables=host(self.input_tables[:bs]), persistent_rows=host(self.table[dev_idx]),
            num_blocks=self._num_blocks[self.rows].copy(),
            num_computed=host(self.num_computed[dev_idx]),
            last_sampled=host(self.last_sampled[dev_idx]), temperature=host(self.b_temp[:bs]),
            top_p=host(self.b_top_p[:bs]), top_k=host(self.b_top_k[:bs]))


def time_steps(bs: int, max_blocks: int, steps: int, device: torch.device | str, *,
               warmup: int = 20, page_size: int = 16, seed: int = 0) -> dict[str, Any]:
    """Time ``steps`` decode steps after ``warmup``, rows as long as the table allows (about
    ``max_blocks * page_size`` tokens, as a long-context batch). ``host_us_median``: the
    median host µs of a step's metadata part; ``gpu_us_per_step``: CUDA-event µs per whole
    step (None on CPU); ``gather_ok``: the gathered rows equal each request's pages."""
    context = max_blocks * page_size - (warmup + steps) - page_size
    if context < 1:
        raise ValueError(f"{warmup + steps} steps do not fit {max_blocks} pages of "
                         f"{page_size}: raise max_blocks or step less")
    s = Mrv2StyleStep(bs, max_blocks, device, context_len=context, page_size=page_size,
                      seed=seed)
    for _ in range(warmup):
        s.step()
    h2d0, launches0 = s.h2d_copies, s.launches
    host = np.zeros(steps, dtype=np.int64)
    events = None
    if s.cuda:
        torch.cuda.synchronize(s.device)
        events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        events[0].record()
    for i in range(steps):
        s.step()
        host[i] = s.last_host_ns
    gpu_us = None
    if events is not None:
        events[1].record()
        torch.cuda.synchronize(s.device)
        gpu_us = events[0].elapsed_time(events[1]) * 1e3 / steps
    r = s.readback()
    ok = all(np.array_equal(r.block_tables[b, :n], s.page_ids[b, :n])
             for b, n in enumerate(r.num_blocks.tolist()))
    return {"bs": bs, "max_blocks": max_blocks, "steps": steps,
            "host_us_median": float(np.median(host)) / 1e3, "gpu_us_per_step": gpu_us,
            "h2d_per_step": (s.h2d_copies - h2d0) / steps,
            "launches_per_step": (s.launches - launches0) / steps, "gather_ok": ok}
