"""The one ATOM-style re-creation (``tests-integration/peers``) builds and copies what the ATOM
catalog says each family's step uploads.

Each family's step runs on CPU at small sizes; every destination it copies is compared with
an oracle written from the catalog's words (plain Python loops, not the re-creation's numpy),
and its ``copy_`` calls are counted: plain MHA decode 10, MHA+MTP verify 13, GDN+MTP 15, V4
fp8 decode 23. Rows shrink between steps that reuse one source set, so a row not zeroed at
full width would show its old pages.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from peers.atom_families import MtpVerifyStep, V4DecodeStep
from peers.atom_style import MHA_FIELDS, AtomStyleError, MhaDecodeStep

from h2d_runner_adapters import BatchColumns, ScheduledBatch, SpanColumns

PS = 4  # tokens per page


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The number of ``Tensor.copy_`` calls since the test began (one element)."""
    count = [0]
    original = torch.Tensor.copy_

    def counted(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        count[0] += 1
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "copy_", counted)
    yield count


def _cols(ctx: list[int], q: int = 1) -> BatchColumns:
    n = len(ctx)
    return BatchColumns(
        query_lens=np.full(n, q, np.int32), context_lens=np.array(ctx, np.int32),
        temperatures=np.array([0.0, 0.7, 1.5, 0.0][:n], np.float32),
        top_k=np.full(n, -1, np.int32), top_p=np.ones(n, np.float32),
        prev_sample_rows=np.arange(n, dtype=np.int32)[::-1].copy(),
        token_ids=np.arange(100, 100 + n * q, dtype=np.int32),
        num_drafts=np.full(n, q - 1, np.int32))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# -- plain MHA decode (catalog §2.3, §3a) -------------------------------------------------
SENTINEL = 77


def _mha_dests(reqs: int, pages: int) -> dict[str, torch.Tensor]:
    # longer than the step writes, filled with a sentinel: what is not copied stays 77
    extra = {"block_tables": (reqs, pages)}
    return {name: torch.full(extra.get(name, (2 * reqs + 2,)), SENTINEL, dtype=dt)
            for name, dt in MHA_FIELDS.items()}


def _mha_oracle(ctx: list[int], lists: list[list[int]], p: int, pages: int,
                temps: np.ndarray) -> dict[str, list]:
    """Positions = ctx - 1; slot = table[pos // ps] * ps + pos % ps; the KV prefix sums
    ceil(ctx / ps); rows full width, zero past their length; padded requests: zero
    positions, rows and lengths, slot -1, prefixes repeated, token 0, source -1."""
    n = len(ctx)
    pos = [c - 1 for c in ctx] + [0] * (p - n)
    rows = [row + [0] * (pages - len(row)) for row in lists] + [[0] * pages] * (p - n)
    slots = [lists[i][pos[i] // PS] * PS + pos[i] % PS for i in range(n)] + [-1] * (p - n)
    indptr = [0]
    for c in ctx:
        indptr.append(indptr[-1] + _ceil(c, PS))
    indptr += [indptr[-1]] * (p - n)
    query = [min(i, n) for i in range(p + 1)]
    return {"positions": pos, "block_tables": rows, "slot_mapping": slots,
            "kv_indptr": indptr, "context_lens": ctx + [0] * (p - n), "cu_seqlens_q": query,
            "decode_cu": query, "input_ids": list(range(100, 100 + n)) + [0] * (p - n),
            "decode_src": list(range(n))[::-1] + [-1] * (p - n),
            # greedy rows clamped to the sampler's epsilon; real rows only
            "temperatures": [float(np.float32(max(float(t), 1e-10))) for t in temps]}


def test_mha_decode_copies_the_catalog_arrays(copies: list[int]) -> None:
    reqs, pages = 4, 6
    dests = _mha_dests(reqs, pages)
    step = MhaDecodeStep(dests, PS)
    # the third step reuses the first one's source set with shorter rows
    cases = [([21, 10, 7], [[9, 8, 7, 6, 5, 4], [3, 2, 1], [11, 12]], 4),
             ([2, 5], [[13], [14, 15]], None),
             ([6, 3, 4], [[16, 17], [18], [19]], 4)]
    for ctx, lists, padded in cases:
        for t in dests.values():  # what this step does not copy stays the sentinel
            t.fill_(SENTINEL)
        before = copies[0]
        cols = _cols(ctx)
        staged = step.publish(cols, lists, padded)
        assert copies[0] - before == 10
        n = len(ctx)
        p = n if padded is None else padded
        want = _mha_oracle(ctx, lists, p, pages, cols.temperatures)
        assert staged.num_pages == want["kv_indptr"][n]
        for name, values in want.items():
            got = dests[name][: len(values)].tolist()
            assert got == values, f"{name}: {got} != {values}"
        # nothing past what the step publishes (temperatures: real rows only)
        assert (dests["temperatures"][n:] == SENTINEL).all()
        assert (dests["positions"][p:] == SENTINEL).all()
        assert (dests["kv_indptr"][p + 1 :] == SENTINEL).all()


def test_mha_decode_refuses_before_writing() -> None:
    dests = _mha_dests(2, 3)
    step = MhaDecodeStep(dests, PS)
    sets = step.sources.sets
    for s in sets:
        for t in s.values():
            t.fill_(7)
    before = ([{k: t.clone() for k, t in s.items()} for s in sets],
              {k: t.clone() for k, t in dests.items()}, step.sources.turn)
    with pytest.raises(AtomStyleError, match="one token per request"):
        step.publish(_cols([5, 6], q=2), [[1, 2], [3, 4]])
    assert step.sources.turn == before[2]  # checked after each: two turns would cancel
    with pytest.raises(AtomStyleError, match="page lists"):
        step.publish(_cols([5, 6]), [[1, 2]])
    # no destination, no source set and not the set rotation changed
    for s, was in zip(sets, before[0], strict=True):
        assert all(torch.equal(t, was[k]) for k, t in s.items())
    assert all(torch.equal(t, before[1][k]) for k, t in dests.items())
    assert step.sources.turn == before[2]
    step.publish(_cols([5, 6]), [[1, 2], [3, 4]])  # a retry works
    assert dests["positions"][:2].tolist() == [4, 5]
    with pytest.raises(AtomStyleError, match="destination block_tables"):
        MhaDecodeStep({**dests, "block_tables": dests["block_tables"].long()}, PS)


# -- MHA+MTP and GDN+MTP verify (catalog §2.1, §2.5, §3d) ---------------------------------
@pytest.mark.parametrize(("gdn", "k"), [(False, 1), (False, 2), (True, 1)])
def test_mtp_verify_copies_the_catalog_arrays(copies: list[int], gdn: bool, k: int) -> None:
    q = k + 1
    step = MtpVerifyStep(3, k, 6, PS, "cpu", gdn=gdn, num_sets=1)
    cases = [([21, 11, 8], [[9, 8, 7, 6, 5, 4], [3, 2, 1], [11, 12]]),
             ([6, 7, 3], [[13, 14], [15, 16], [17]])]  # shorter rows, the same source set
    for ctx, lists in cases:
        n = len(ctx)
        cols = _cols(ctx, q)
        batch = ScheduledBatch((), False, PS, given_columns=cols, given_block_tables=lists)
        before = copies[0]
        step.step(batch, lists)
        assert copies[0] - before == (15 if gdn else 13)
        # each request's q tokens end at its context length (which includes them)
        pos = [c - q + j for c in ctx for j in range(q)]
        req = [i for i in range(n) for _ in range(q)]
        want = {
            "positions": pos,
            "slot_mapping": [lists[i][p // PS] * PS + p % PS
                             for i, p in zip(req, pos, strict=True)],
            "block_tables": [row + [0] * (6 - len(row)) for row in lists],
            "context_lens": ctx, "cu_seqlens_q": [i * q for i in range(n + 1)],
            "decode_cu": [i * q for i in range(n + 1)],
            "kv_indptr": [sum(_ceil(c, PS) for c in ctx[:i]) for i in range(n + 1)],
            "input_ids": list(range(100, 100 + n * q)),
            "decode_src": list(range(n))[::-1],
            # the verify trio: the draft rows of each request, the drafts' running count,
            # the bonus row after them
            "target_logits_indices": [i * q + j for i in range(n) for j in range(k)],
            "cu_num_draft_tokens": [(i + 1) * k for i in range(n)],
            "bonus_logits_indices": [i * q + k for i in range(n)],
        }
        if gdn:
            want["gdn_cu_seqlens_q"] = want["cu_seqlens_q"]
            want["spec_state_indices"] = [[i * q + j for j in range(q)] for i in range(n)]
        for name, values in want.items():
            got = step.dests[name][: len(values)].tolist()
            assert got == values, f"{name}: {got} != {values}"
        if gdn:  # the per-request scalar stores of the accepted counts
            assert step.num_accepted.tolist() == [1 + i % q for i in range(n)]


# -- DeepSeek-V4 fp8 decode (catalog §2.4, §3c; model-family §1.4-1.6) --------------------
def test_v4_decode_copies_the_catalog_arrays(copies: list[int]) -> None:
    step = V4DecodeStep(2, 4, "cpu", window=4, index_topk=2, envelope_rows=3, num_sets=1)
    slots_out, slots_in = np.array([5, 6], np.int32), np.array([7, 6], np.int32)

    def run(ctx: list[int], lists: list[list[int]]) -> None:
        spans = SpanColumns(np.ones(2, np.int32), np.array(ctx, np.int32), slots_out, slots_in)
        before = copies[0]
        step.step(spans, lists)
        assert copies[0] - before == 23

    run([1024, 1024], [[1, 2, 3, 4], [5, 6, 7, 8]])  # full rows first: the stale case
    step.dests["hca_idx"].fill_(SENTINEL)
    run([300, 517], [[11, 12], [21, 22, 23]])
    d = {name: t.tolist() for name, t in step.dests.items()}
    rows = [[11, 12, 0, 0], [21, 22, 23, 0]]
    assert d["positions"] == [299, 516] and d["cu_seqlens_q"] == [0, 1, 2]
    assert d["context_lens"] == [300, 517] and d["block_tables"] == rows
    assert d["slot_out"] == [5, 6] and d["slot_in"] == [7, 6]
    # plans [token, request, position, window_len]: ratio 4 compresses where position + 1
    # is a multiple of 4 (300; 517 is not), window 2*4 - 1; ratio 128 nowhere, window 127;
    # every token writes its state; -1 rows past the compress rows
    assert d["compress_4"][:2] == [[0, 0, 299, 7], [-1, -1, -1, -1]]
    assert d["write_4"][:2] == [[0, 0, 299, 7], [1, 1, 516, 7]]
    assert d["compress_128"][:2] == [[-1] * 4, [-1] * 4]
    assert d["write_128"][:2] == [[0, 0, 299, 127], [1, 1, 516, 127]]
    assert d["batch_id"] == [0, 1] and d["ncsa"] == [75, 129]  # ctx // 4
    # swa = min(p+1, 4) = 4; csa adds min(min((p+1)//4, ctx//4), 2) = 2; hca adds ctx//128
    assert d["ind_swa"] == [0, 4, 8] and d["ind_csa"] == [0, 6, 12]
    assert d["ind_hca"] == [0, 6, 14] and d["n_committed"] == [75, 129]
    assert d["bt_per_token"] == rows  # one token per request: its request's row
    # HCA head: entry e is row[e // 2] * 3 + e % 2 (two 128-token entries per block), then
    # the window tail staged as -1; nothing past hca_indptr[T] is copied
    head = [33, 34, -1, -1, -1, -1, 63, 64, 66, 67, -1, -1, -1, -1]
    assert d["hca_idx"][:14] == head and set(d["hca_idx"][14:]) == {SENTINEL}
    assert d["qo_indptr"] == [0, 1, 2] and d["decode_cu"] == [0, 1, 2]
    with pytest.raises(AtomStyleError, match="one token per request"):
        step.step(SpanColumns(np.array([2, 1], np.int32), np.array([8, 9], np.int32),
                              slots_out, slots_in), [[1], [2]])
