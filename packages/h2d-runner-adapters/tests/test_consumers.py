"""First-consumer kernels against plain-torch references and hand-written cases.

CPU cases run the Triton kernels in the interpreter (``TRITON_INTERPRET=1``, as the
nox ``tests`` session sets); CUDA cases (``RUN_H2D_GPU_TESTS=1``) need compiled
kernels, i.e. ``TRITON_INTERPRET`` unset. Triton picks one mode per process, so
each run skips the half its mode cannot execute, saying why.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from h2d_runner_adapters.consumers import (
    GREEDY_TEMPERATURE,
    ConsumerArgumentError,
    assemble_token_ids,
    fill_gumbel_noise_,
    gather_draft_ids,
    generate_kv_indices,
    prefill_attention,
    prepare_prefill_attention,
    sample_tokens,
    token_assembly,
)
from h2d_runner_adapters.consumers._launch import interpreted
from h2d_runner_adapters.consumers.reference import (
    assemble_token_ids_reference,
    gather_draft_ids_reference,
    generate_kv_indices_reference,
    prepare_prefill_attention_reference,
    sample_tokens_reference,
)
from h2d_runner_adapters.draft import gather as draft_gather
from h2d_runner_adapters.mha import kv_indices
from h2d_runner_adapters.sampling import sampler
from h2d_runner_adapters.sampling.filters import (
    logit_cutoffs,
    normalize_top_k,
    normalize_top_p,
)

I32 = torch.int32
POISON = -7


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _variants(kernel: Any) -> int:
    """Compiled variants of a JIT kernel (all devices, all constexpr combinations)."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


class _CompileCounter:
    """On CUDA, asserts that a run of calls compiled at most ``allowed`` new variants."""

    def __init__(self, dev: torch.device, *kernels: Any) -> None:
        self.dev = dev
        self.kernels = kernels
        self.before = [_variants(k) for k in kernels] if dev.type == "cuda" else []

    def check(self, allowed: int = 1) -> None:
        if self.dev.type != "cuda":
            return  # the interpreter compiles nothing
        for kernel, before in zip(self.kernels, self.before, strict=True):
            assert _variants(kernel) - before <= allowed, kernel


# --------------------------------------------------------------------------- token assembly


def _token_batch(
    gen: torch.Generator, num_real: int, num_padded: int, width: int, prev_rows: int
) -> dict[str, Any]:
    """A decode batch: mixed deferred / host-staged requests, then padded requests."""
    counts, sources = [], []
    for _ in range(num_real):
        deferred = bool(torch.rand((), generator=gen) < 0.6)
        if deferred:
            counts.append(int(torch.randint(1, width + 1, (), generator=gen)))
            sources.append(int(torch.randint(0, prev_rows, (), generator=gen)))
        else:
            counts.append(int(torch.randint(1, 6, (), generator=gen)))
            sources.append(-1)
    counts += [0] * num_padded
    sources += [-1] * num_padded
    cu = [0]
    for c in counts:
        cu.append(cu[-1] + c)
    capacity = cu[-1] + 9  # [N+1] with a poisoned tail that must stay as it is
    return {
        "input_ids": torch.randint(0, 50_000, (capacity,), dtype=I32, generator=gen),
        "decode_cu": torch.tensor(cu + [10**6] * 3, dtype=I32),  # tail past R+1 never read
        "decode_src": torch.tensor(sources + [0] * 3, dtype=I32),
        "prev_sampled": torch.randint(60_000, 90_000, (prev_rows, width), dtype=I32, generator=gen),
        "num_reqs": num_real + num_padded,
    }


def _to(batch: dict[str, Any], dev: torch.device) -> dict[str, Any]:
    return {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def test_assemble_token_ids_hand_written(dev: torch.device) -> None:
    input_ids = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17, 18, 19], dtype=I32, device=dev)
    # Request 0: 2 deferred tokens from row 1; request 1: host-staged; request 2: 1 token from
    # row 0; request 3: padded (empty span, -1); request 4: source outside prev_sampled.
    decode_cu = torch.tensor([0, 2, 5, 6, 6, 7], dtype=I32, device=dev)
    decode_src = torch.tensor([1, -1, 0, -1, 2], dtype=I32, device=dev)
    prev = torch.tensor([[100, 101], [200, 201]], dtype=I32, device=dev)
    assemble_token_ids(input_ids, decode_cu, decode_src, prev, 5)
    assert input_ids.cpu().tolist() == [200, 201, 12, 13, 14, 100, 16, 17, 18, 19]
    # W = 3: a deferred span of 4 tokens takes 3 and keeps its staged 4th token.
    prev3 = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=I32, device=dev)
    ids = torch.tensor([10, 11, 12, 13, 14, 15], dtype=I32, device=dev)
    cu = torch.tensor([0, 1, 5], dtype=I32, device=dev)
    assemble_token_ids(ids, cu, torch.tensor([-1, 0], dtype=I32, device=dev), prev3, 2)
    assert ids.cpu().tolist() == [10, 1, 2, 3, 14, 15]


def test_assemble_token_ids_matches_reference(dev: torch.device) -> None:
    batch = _token_batch(_gen(1), num_real=37, num_padded=5, width=3, prev_rows=20)
    # A deferred span longer than W keeps its staged tail; out-of-range sources write nothing.
    batch["decode_src"][3] = 20
    batch["decode_src"][4] = -5
    before = batch["input_ids"].clone()
    expected = assemble_token_ids_reference(**batch)
    on_dev = _to(batch, dev)
    assemble_token_ids(**on_dev)
    got = on_dev["input_ids"].cpu()
    assert torch.equal(got, expected)
    total = int(batch["decode_cu"][batch["num_reqs"]])
    assert torch.equal(got[total:], before[total:])
    assert not torch.equal(got, before)


def test_assemble_token_ids_long_deferred_span_fills_first_w() -> None:
    # Reference semantics check independent of the device: span of 3 tokens, W = 2.
    ids = torch.tensor([5, 6, 7, 8], dtype=I32)
    out = assemble_token_ids_reference(
        ids, torch.tensor([0, 3], dtype=I32), torch.tensor([0], dtype=I32),
        torch.tensor([[40, 41]], dtype=I32), 1,
    )
    assert out.tolist() == [40, 41, 7, 8]


def test_assemble_token_ids_changing_batch_sizes(dev: torch.device) -> None:
    counter = _CompileCounter(dev, token_assembly._assemble_kernel)
    for seed, (real, padded) in enumerate([(1, 0), (7, 1), (131, 5), (3, 13)]):
        batch = _token_batch(_gen(10 + seed), real, padded, width=2, prev_rows=8)
        expected = assemble_token_ids_reference(**batch)
        on_dev = _to(batch, dev)
        assemble_token_ids(**on_dev)
        assert torch.equal(on_dev["input_ids"].cpu(), expected), (real, padded)
    counter.check()


def test_assemble_token_ids_rejects_without_writing(dev: torch.device) -> None:
    batch = _to(_token_batch(_gen(2), 4, 0, 2, 4), dev)
    before = batch["input_ids"].clone()
    with pytest.raises(ConsumerArgumentError, match="decode_src"):
        assemble_token_ids(
            batch["input_ids"], batch["decode_cu"], batch["decode_src"].long(),
            batch["prev_sampled"], batch["num_reqs"],
        )
    with pytest.raises(ConsumerArgumentError, match="decode_cu"):
        assemble_token_ids(
            batch["input_ids"], batch["decode_cu"][:3], batch["decode_src"],
            batch["prev_sampled"], batch["num_reqs"],
        )
    with pytest.raises(ConsumerArgumentError, match="num_reqs"):
        assemble_token_ids(
            batch["input_ids"], batch["decode_cu"], batch["decode_src"], batch["prev_sampled"],
            torch.tensor(4),  # type: ignore[arg-type]
        )
    assert torch.equal(batch["input_ids"], before)


# --------------------------------------------------------------------------- draft gather


def test_gather_draft_ids(dev: torch.device) -> None:
    gen = _gen(3)
    counter = _CompileCounter(dev, draft_gather._gather_kernel)
    input_ids = torch.randint(0, 50_000, (50,), dtype=I32, generator=gen)
    for count in (12, 1, 1500, 5):
        indices = torch.randint(0, 49, (count,), dtype=torch.int64, generator=gen)
        indices[0] = 48  # the last valid index reads input_ids[49]
        if count > 2:
            indices[1] = -1  # padding: writes nothing
            indices[2] = 49  # 1 + 49 is past input_ids: writes nothing
        out = torch.randint(-100, -50, (count + 9,), dtype=I32, generator=gen)
        expected = gather_draft_ids_reference(input_ids, indices, out)
        out_dev = out.to(dev)
        view = gather_draft_ids(input_ids.to(dev), indices.to(dev), out_dev)
        assert view.shape == (count,) and view.data_ptr() == out_dev.data_ptr()
        got = out_dev.cpu()
        assert torch.equal(got, expected)
        assert torch.equal(got[count:], out[count:])
        assert int(got[0]) == int(input_ids[49])
        if count > 2:
            assert got[1:3].tolist() == out[1:3].tolist()
    counter.check()


def test_gather_draft_ids_rejects_int32_indices(dev: torch.device) -> None:
    out = torch.zeros(4, dtype=I32, device=dev)
    with pytest.raises(ConsumerArgumentError, match=r"target_logits_indices.*int64"):
        gather_draft_ids(torch.ones(8, dtype=I32, device=dev), torch.zeros(4, dtype=I32,
                         device=dev), out)
    with pytest.raises(ConsumerArgumentError, match="out has 2 elements"):
        gather_draft_ids(torch.ones(8, dtype=I32, device=dev),
                         torch.zeros(4, dtype=torch.int64, device=dev), out[:2])


# --------------------------------------------------------------------------- KV indices


def _kv_case(
    gen: torch.Generator, pages: list[int], capacity_rows: int, columns: int
) -> dict[str, Any]:
    num_rows = len(pages)
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + p)
    # Entries past num_rows + 1 hold garbage: they must never be read.
    indptr += [10**6 + i for i in range(capacity_rows + 1 - len(indptr))]
    return {
        "block_tables": torch.randint(1, 100_000, (capacity_rows, columns), dtype=I32,
                                      generator=gen),
        "kv_indptr": torch.tensor(indptr, dtype=I32),
        "kv_indices": torch.full((sum(pages) + 11,), POISON, dtype=I32),
        "num_rows": num_rows,
    }


def test_generate_kv_indices_matches_reference(dev: torch.device) -> None:
    # Rows 4 and 5 are graph padding: their indptr repeats the total.
    case = _kv_case(_gen(4), [3, 7, 1, 5, 0, 0], capacity_rows=9, columns=7)
    expected = generate_kv_indices_reference(**case)
    on_dev = _to(case, dev)
    generate_kv_indices(**on_dev)
    got = on_dev["kv_indices"].cpu()
    assert torch.equal(got, expected)
    tables = case["block_tables"]
    assert got[:3].tolist() == tables[0, :3].tolist()
    assert got[3:10].tolist() == tables[1, :7].tolist()
    assert (got[16:] == POISON).all()


def test_generate_kv_indices_row_wider_than_table(dev: torch.device) -> None:
    # Row 1 claims 9 pages but the table has 7 columns: it gets 7, its last 2 slots stay.
    case = _kv_case(_gen(12), [3, 9, 2], capacity_rows=3, columns=7)
    on_dev = _to(case, dev)
    generate_kv_indices(**on_dev)
    got = on_dev["kv_indices"].cpu()
    assert torch.equal(got, generate_kv_indices_reference(**case))
    assert got[3:10].tolist() == case["block_tables"][1].tolist()
    assert (got[10:12] == POISON).all()
    assert got[12:14].tolist() == case["block_tables"][2, :2].tolist()


def test_generate_kv_indices_wide_rows(dev: torch.device) -> None:
    width = kv_indices.BLOCK_COLUMNS + 76  # two column chunks per row
    case = _kv_case(_gen(5), [width, 0, width - 70], capacity_rows=3, columns=width)
    expected = generate_kv_indices_reference(**case)
    on_dev = _to(case, dev)
    generate_kv_indices(**on_dev)
    assert torch.equal(on_dev["kv_indices"].cpu(), expected)


def test_generate_kv_indices_changing_batch_sizes(dev: torch.device) -> None:
    gen = _gen(6)
    counter = _CompileCounter(dev, kv_indices._kv_indices_kernel)
    for rows in (1, 5, 16, 2, 0):
        pages = torch.randint(0, 9, (rows,), generator=gen).tolist()
        case = _kv_case(gen, [*pages, 0, 0], capacity_rows=20, columns=8)  # 2 padded rows
        expected = generate_kv_indices_reference(**case)
        on_dev = _to(case, dev)
        generate_kv_indices(**on_dev)
        assert torch.equal(on_dev["kv_indices"].cpu(), expected), rows
    counter.check()


def test_generate_kv_indices_rejects_short_indptr(dev: torch.device) -> None:
    case = _to(_kv_case(_gen(7), [2, 2], capacity_rows=2, columns=4), dev)
    case["block_tables"] = torch.ones(3, 4, dtype=I32, device=dev)
    with pytest.raises(ConsumerArgumentError, match="kv_indptr has 3 elements, needs at least 4"):
        generate_kv_indices(case["block_tables"], case["kv_indptr"], case["kv_indices"], 3)
    assert (case["kv_indices"] == POISON).all()


# --------------------------------------------------------------------------- prefill


def _prefill_case(
    gen: torch.Generator, real: int, padded: int, page_size: int, tokens: int,
    columns: int | None = None,
) -> dict[str, Any]:
    q = torch.randint(0, 10, (real,), generator=gen)
    q[0] = max(int(q[0]), 1)
    if real > 2:
        q[1] = 0  # an empty request mid-batch
    cached = torch.randint(0, 21, (real,), generator=gen)
    k = q + cached
    cu_q = [0] + torch.cumsum(q, 0).tolist() + [int(q.sum())] * padded
    cu_k = [0] + torch.cumsum(k, 0).tolist() + [int(k.sum())] * padded
    num_reqs = real + padded
    needed = max(math.ceil(int(k.max()) / page_size), 1)
    assert columns is None or columns >= needed
    columns = columns or needed
    total_pages = sum(math.ceil(int(x) / page_size) for x in k)
    return {
        "cu_seqlens_q": torch.tensor(cu_q + [99_999] * 2, dtype=I32),
        "cu_seqlens_k": torch.tensor(cu_k + [99_999] * 2, dtype=I32),
        "block_tables": torch.randint(1, 100_000, (num_reqs + 1, columns), dtype=I32,
                                      generator=gen),
        "page_size": page_size,
        "num_reqs": num_reqs,
        "token_request": torch.randint(-100, 100, (tokens,), dtype=I32, generator=gen),
        "kv_indptr": torch.full((num_reqs + 4,), POISON, dtype=I32),
        "kv_indices": torch.full((total_pages + 13,), POISON, dtype=I32),
    }


def _check_prefill(case: dict[str, Any], dev: torch.device) -> None:
    owners, indptr, indices = prepare_prefill_attention_reference(**case)
    on_dev = _to(case, dev)
    prepare_prefill_attention(**on_dev)
    assert torch.equal(on_dev["token_request"].cpu(), owners)
    assert torch.equal(on_dev["kv_indptr"].cpu(), indptr)
    assert torch.equal(on_dev["kv_indices"].cpu(), indices)
    n = case["num_reqs"]
    assert (on_dev["kv_indptr"].cpu()[n + 1 :] == POISON).all()
    total_pages = int(indptr[n])
    assert (on_dev["kv_indices"].cpu()[total_pages:] == POISON).all()


def test_prepare_prefill_attention_hand_written(dev: torch.device) -> None:
    # Requests: 3 tokens (5 keys), 0 tokens (4 keys), 4 tokens (11 keys); one padded.
    cu_q = torch.tensor([0, 3, 3, 7, 7], dtype=I32, device=dev)
    cu_k = torch.tensor([0, 5, 9, 20, 20], dtype=I32, device=dev)
    tables = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 42]], dtype=I32,
                          device=dev)
    owners = torch.full((10,), 55, dtype=I32, device=dev)
    indptr = torch.full((6,), POISON, dtype=I32, device=dev)
    indices = torch.full((9,), POISON, dtype=I32, device=dev)
    prepare_prefill_attention(cu_q, cu_k, tables, 4, 4, owners, indptr, indices)
    assert owners.cpu().tolist() == [0, 0, 0, 2, 2, 2, 2, -1, -1, -1]
    assert indptr.cpu().tolist() == [0, 2, 3, 6, 6, POISON]
    assert indices.cpu().tolist() == [10, 11, 20, 30, 31, 32, POISON, POISON, POISON]


def test_prepare_prefill_attention_matches_reference(dev: torch.device) -> None:
    _check_prefill(_prefill_case(_gen(8), real=6, padded=2, page_size=3, tokens=80), dev)


def test_prepare_prefill_attention_many_tokens(dev: torch.device) -> None:
    # More tokens than one program assigns, and a token tensor much longer than the batch.
    case = _prefill_case(_gen(9), real=40, padded=0, page_size=16,
                         tokens=prefill_attention.BLOCK_TOKENS + 300)
    _check_prefill(case, dev)


def test_prepare_prefill_attention_changing_batch_sizes(dev: torch.device) -> None:
    gen = _gen(10)
    counter = _CompileCounter(dev, prefill_attention._prefill_prepare_kernel,
                              kv_indices._kv_indices_kernel)
    for real, padded in [(1, 0), (5, 3), (17, 0), (2, 1)]:
        # Fixed capacities and table width, as with real buffers (a new stride could be a
        # new specialization); the prefixes are padded to 33 entries.
        case = _prefill_case(gen, real, padded, page_size=4, tokens=200, columns=8)
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            t = case[name]
            case[name] = torch.cat([t, t[-1:].repeat(33 - t.numel())])
        case["kv_indptr"] = torch.full((33,), POISON, dtype=I32)
        _check_prefill(case, dev)
    counter.check()


def test_prepare_prefill_attention_rejects_zero_page_size(dev: torch.device) -> None:
    case = _to(_prefill_case(_gen(11), 3, 0, 4, 16), dev)
    before = case["token_request"].clone()
    with pytest.raises(ConsumerArgumentError, match="page_size must be >= 1"):
        prepare_prefill_attention(**{**case, "page_size": 0})
    assert torch.equal(case["token_request"], before)
    assert (case["kv_indptr"] == POISON).all()


# --------------------------------------------------------------------------- sampler

VOCAB = 2_500  # two scan blocks of BLOCK_VOCAB


def _sampling_batch(
    gen: torch.Generator, bs: int, vocab: int = VOCAB, greedy_every: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = torch.randn(bs, vocab, generator=gen) * 3.0
    temps = torch.rand(bs, generator=gen) * 1.7 + 0.3
    temps[::greedy_every] = GREEDY_TEMPERATURE
    noise = fill_gumbel_noise_(torch.empty(bs, vocab), gen)
    return logits, temps, noise


def _per_request(bs: int, k: int | None, p: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.full((bs,), -1 if k is None else k, dtype=I32),
        torch.full((bs,), 1.0 if p is None else p, dtype=torch.float32),
    )


FILTERS: list[tuple[str, Any, Any]] = [
    ("none", None, None),
    ("uniform_k", 20, None),
    ("uniform_p", None, 0.85),
    ("uniform_k_p", 50, 0.6),
    ("per_request", torch.tensor([3, -1, 40, 2_500, 7, 1, 0, 12], dtype=I32),
     torch.tensor([0.5, 0.9, 1.0, 0.7, 0.95, 0.3, 0.8, 1.0])),
    ("uniform_k_per_request_p", 30, torch.tensor([0.5, 0.9, 1.0, 0.7, 0.95, 0.3, 0.8, 1.0])),
]


def _dev_filter(x: Any, dev: torch.device) -> Any:
    return x.to(dev) if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize(("name", "top_k", "top_p"), FILTERS, ids=[f[0] for f in FILTERS])
def test_sample_tokens_matches_reference(
    dev: torch.device, name: str, top_k: Any, top_p: Any
) -> None:
    bs = 8
    logits, temps, noise = _sampling_batch(_gen(20), bs)
    expected = sample_tokens_reference(logits, temps, top_k, top_p, noise)
    out = torch.full((bs + 5,), POISON, dtype=I32, device=dev)
    view = sample_tokens(
        logits.to(dev), temps.to(dev), top_k=_dev_filter(top_k, dev),
        top_p=_dev_filter(top_p, dev), noise=noise.to(dev), out=out,
    )
    assert view.shape == (bs,) and view.data_ptr() == out.data_ptr()
    got = out.cpu()
    assert torch.equal(got[:bs], expected), name
    assert (got[bs:] == POISON).all()
    greedy = temps <= GREEDY_TEMPERATURE
    assert torch.equal(got[:bs][greedy], logits.argmax(dim=1).to(I32)[greedy])


def test_sample_tokens_greedy_rows_are_exact_argmax(dev: torch.device) -> None:
    bs = 5
    gen = _gen(21)
    logits = torch.randn(bs, VOCAB, generator=gen)
    # Ties: the first maximal index wins, within a block and across blocks.
    logits[0, 7] = logits[0, 300] = 50.0
    logits[1, 100] = logits[1, 2_300] = 50.0
    logits[2, 2_400] = logits[2, 2_450] = 50.0
    temps = torch.full((bs,), GREEDY_TEMPERATURE)
    # Adjacent floats whose quotients by the greedy temperature round to one value:
    # dividing greedy rows would turn the larger one into a tie lost to the earlier index.
    low = torch.tensor(60.00004959106445)
    high = torch.nextafter(low, torch.tensor(float("inf")))
    assert low / temps[0] == high / temps[0]
    logits[3, 10], logits[3, 11] = low, high
    # Larger than logits / GREEDY_TEMPERATURE: it would decide the result if it were used.
    noise = torch.rand(bs, VOCAB, generator=gen) * 1e20
    for top_k, top_p in [(None, None), (2, 0.1), (torch.full((bs,), 1, dtype=I32), None)]:
        out = sample_tokens(
            logits.to(dev), temps.to(dev), top_k=_dev_filter(top_k, dev), top_p=top_p,
            noise=noise.to(dev),
        )
        got = out.cpu()
        assert torch.equal(got, logits.argmax(dim=1).to(I32))
        assert got[:4].tolist() == [7, 100, 2_400, 11]


@pytest.mark.parametrize(("k", "p"), [(20, None), (None, 0.85), (50, 0.6), (1, 0.3)])
def test_uniform_and_per_request_filters_agree(
    dev: torch.device, k: int | None, p: float | None
) -> None:
    bs = 6
    logits, temps, noise = _sampling_batch(_gen(22), bs)
    args = (logits.to(dev), temps.to(dev))
    uniform = sample_tokens(*args, top_k=k, top_p=p, noise=noise.to(dev)).cpu()
    ks, ps = _per_request(bs, k, p)
    per_request = sample_tokens(
        *args, top_k=ks.to(dev), top_p=ps.to(dev), noise=noise.to(dev)
    ).cpu()
    assert torch.equal(uniform, per_request)
    # Disabled per-request values behave exactly like no filter at all.
    off_k, off_p = _per_request(bs, None, None)
    off = sample_tokens(*args, top_k=off_k.to(dev), top_p=off_p.to(dev), noise=noise.to(dev))
    assert torch.equal(off.cpu(), sample_tokens(*args, noise=noise.to(dev)).cpu())


def test_filters_keep_exactly_the_defined_tokens(dev: torch.device) -> None:
    # Probabilities 0.4, 0.25, 0.15, 0.1, 0.05, 0.05 at T = 1. With top_p = 0.75 the mass
    # before each token is 0, 0.4, 0.65, 0.8, ...: tokens 0-2 are kept, 3-5 are not.
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.05])
    logits = probs.log()[None, :].repeat(6, 1)
    temps = torch.ones(6)
    noise = torch.zeros(6, 6)
    for row, token in enumerate(range(6)):
        noise[row, token] = 100.0  # each row's boosted token wins if, and only if, it is kept
    got = sample_tokens(logits.to(dev), temps.to(dev), top_p=0.75, noise=noise.to(dev)).cpu()
    assert got.tolist() == [0, 1, 2, 0, 0, 0]
    got = sample_tokens(logits.to(dev), temps.to(dev), top_k=2, noise=noise.to(dev)).cpu()
    assert got.tolist() == [0, 1, 0, 0, 0, 0]
    got = sample_tokens(logits.to(dev), temps.to(dev), noise=noise.to(dev)).cpu()
    assert got.tolist() == [0, 1, 2, 3, 4, 5]
    # Per request: row r keeps its top ks[r] tokens (6 = the whole vocabulary = off).
    ks = torch.tensor([1, 2, 2, 5, 4, 6], dtype=I32)
    got = sample_tokens(logits.to(dev), temps.to(dev), top_k=ks.to(dev), noise=noise.to(dev))
    assert got.cpu().tolist() == [0, 1, 0, 3, 0, 5]
    # A disabled per-request top-k (-1, or >= V) leaves top-p alone, and vice versa.
    ks = torch.tensor([-1, 6, -1, 6, -1, 6], dtype=I32)
    ps = torch.full((6,), 0.75)
    got = sample_tokens(logits.to(dev), temps.to(dev), top_k=ks.to(dev), top_p=ps.to(dev),
                        noise=noise.to(dev))
    assert got.cpu().tolist() == [0, 1, 2, 0, 0, 0]
    ks = torch.tensor([1, 2, 3, 4, 5, 1], dtype=I32)
    ps = torch.ones(6)
    got = sample_tokens(logits.to(dev), temps.to(dev), top_k=ks.to(dev), top_p=ps.to(dev),
                        noise=noise.to(dev))
    assert got.cpu().tolist() == [0, 1, 2, 3, 4, 0]


def test_disabled_top_p_keeps_the_tail_of_a_peaked_row(dev: torch.device) -> None:
    # One token holds all but ~1e-8 of the mass: the float32 mass before every other token
    # rounds to 1.0. A disabled top_p (1.0, uniform or per request) must still keep them.
    logits = torch.tensor([[20.0, 0.0, 0.0, 0.0]] * 2)
    temps = torch.ones(2)
    noise = torch.tensor([[0.0, 0.0, 0.0, 100.0]] * 2)
    per_request = torch.tensor([1.0, 0.5])
    got = sample_tokens(logits.to(dev), temps.to(dev), top_p=per_request.to(dev),
                        noise=noise.to(dev))
    assert got.cpu().tolist() == [3, 0]
    got = sample_tokens(logits.to(dev), temps.to(dev), top_p=1.0, noise=noise.to(dev))
    assert got.cpu().tolist() == [3, 3]


def test_sampling_follows_the_filtered_distribution(dev: torch.device) -> None:
    rows, vocab, temp = 500, 6, 0.8
    base = torch.tensor([1.0, 0.5, 0.2, -0.3, 2.0, -1.0])
    logits = base[None, :].repeat(rows, 1)
    temps = torch.full((rows,), temp)
    noise = fill_gumbel_noise_(torch.empty(rows, vocab), _gen(23))
    got = sample_tokens(logits.to(dev), temps.to(dev), top_k=3, noise=noise.to(dev)).cpu()
    kept = [4, 0, 1]
    target = torch.softmax(base[kept] / temp, dim=0)
    counts = torch.bincount(got.long(), minlength=vocab).float()
    assert counts.sum() == rows and counts[[2, 3, 5]].sum() == 0
    freq = counts[kept] / rows
    sigma = (target * (1 - target) / rows).sqrt()
    assert ((freq - target).abs() < 4 * sigma).all(), (freq, target)


def test_sample_tokens_changing_batch_sizes(dev: torch.device) -> None:
    counter = _CompileCounter(dev, sampler._sample_kernel)
    out = torch.full((20,), POISON, dtype=I32, device=dev)
    for bs in (1, 3, 9, 2):
        logits, temps, noise = _sampling_batch(_gen(24 + bs), bs)
        for top_k in (None, 5):
            expected = sample_tokens_reference(logits, temps, top_k, None, noise)
            sample_tokens(logits.to(dev), temps.to(dev), top_k=top_k, noise=noise.to(dev),
                          out=out)
            assert torch.equal(out.cpu()[:bs], expected), (bs, top_k)
    assert (out.cpu()[9:] == POISON).all()
    counter.check(allowed=2)  # one variant unfiltered, one filtered


def test_sample_tokens_rejects_bad_filters(dev: torch.device) -> None:
    logits, temps, noise = (t.to(dev) for t in _sampling_batch(_gen(25), 4, vocab=16))
    out = torch.full((4,), POISON, dtype=I32, device=dev)
    with pytest.raises(ConsumerArgumentError, match="uniform top_k must be >= 1"):
        sample_tokens(logits, temps, top_k=0, noise=noise, out=out)
    with pytest.raises(ConsumerArgumentError, match=r"uniform top_p must lie in \(0, 1\]"):
        sample_tokens(logits, temps, top_p=1.5, noise=noise, out=out)
    with pytest.raises(ConsumerArgumentError, match="per-request top_k must be a 1-D int32"):
        sample_tokens(logits, temps, top_k=torch.ones(4, device=dev), noise=noise, out=out)
    with pytest.raises(ConsumerArgumentError, match="noise has 15 columns"):
        sample_tokens(logits, temps, noise=noise[:, :15], out=out)
    assert (out == POISON).all()


def test_fill_gumbel_noise_is_seeded_and_gumbel() -> None:
    a = fill_gumbel_noise_(torch.empty(4_000), _gen(26))
    b = fill_gumbel_noise_(torch.empty(4_000), _gen(26))
    assert torch.equal(a, b) and torch.isfinite(a).all()
    assert abs(float(a.mean()) - 0.5772) < 0.06  # Euler-Mascheroni constant
    assert abs(float(a.var()) - math.pi**2 / 6) < 0.2


@pytest.fixture
def no_host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Makes every Python-level device-to-host read of a tensor raise."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tensor value was read on the host")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__",
                 "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    yield


@pytest.mark.parametrize(("name", "top_k", "top_p"), FILTERS, ids=[f[0] for f in FILTERS])
def test_filter_cutoffs_read_nothing_back(
    no_host_reads: None, name: str, top_k: Any, top_p: Any
) -> None:
    logits, temps, _ = _sampling_batch(_gen(27), 8, vocab=64)
    k = normalize_top_k("t", top_k, 64, 8, logits.device)
    p = normalize_top_p("t", top_p, 8, logits.device)
    cutoffs = logit_cutoffs(logits, temps, k, p)
    assert (cutoffs is None) == (name == "none")


@pytest.mark.gpu
def test_consumers_do_no_host_sync_on_cuda() -> None:
    if interpreted(sampler._sample_kernel):
        pytest.skip("needs compiled kernels: unset TRITON_INTERPRET")
    dev = torch.device("cuda")
    logits, temps, noise = (t.to(dev) for t in _sampling_batch(_gen(28), 8))
    out = torch.empty(8, dtype=I32, device=dev)
    tokens = _to(_token_batch(_gen(29), 9, 2, 2, 6), dev)
    kv = _to(_kv_case(_gen(30), [3, 0, 5], capacity_rows=4, columns=6), dev)
    prefill = _to(_prefill_case(_gen(31), 5, 1, 4, 64), dev)
    draft = torch.randint(0, 20, (6,), dtype=torch.int64, device=dev)
    draft_out = torch.empty(6, dtype=I32, device=dev)
    noise_gen = torch.Generator(device=dev).manual_seed(1)
    # filters moved to the device up front: a pageable host-to-device copy synchronizes
    filters = [(_dev_filter(k, dev), _dev_filter(p, dev)) for _, k, p in FILTERS]

    def step() -> None:
        for top_k, top_p in filters:
            sample_tokens(logits, temps, top_k=top_k, top_p=top_p, noise=noise, out=out)
        assemble_token_ids(**tokens)
        gather_draft_ids(tokens["input_ids"], draft, draft_out)
        generate_kv_indices(**kv)
        prepare_prefill_attention(**prefill)
        fill_gumbel_noise_(noise, noise_gen)

    step()  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
