"""The real-model oracles' workload loop: a scheduled run through a runner, its free pages
refilled with garbage before each step, every sampled row's logits kept.

Shared by the Llama and DeepSeek-V3 oracles (``tests-integration/test_*_oracle.py``): the
scheduler's batches go through ``runner.step`` one by one; before each step every page no
request holds (a migration's source excepted: it is copied first) is garbage again
(``decoder.poison_pages``), so a read through a stale page index, slot or length cannot
pass for a correct one; the counters say how often a freed page was handed out again.
"""

from __future__ import annotations

from typing import Any

import torch

from .scheduler import Scheduler

#: every sampled row's logits by (request, the position they predict)
Logits = dict[tuple[int, int], torch.Tensor]


def run_workload(runner: Any, decoder: Any, sched: Scheduler, num_pages: int, steps: int
                 ) -> tuple[dict[int, tuple[list[int], list[int]]], dict[str, Any], Logits]:
    """Run ``sched``'s batches (at most ``steps``) through ``runner`` over ``decoder``'s
    cache of ``num_pages`` pages: the finished requests' (prompt, generated), the
    scheduler's counters plus ``reused_pages``, and the sampled rows' logits."""
    sampled: list[int] | None = None
    logits: Logits = {}
    held: set[int] = set()
    freed: set[int] = set()  # pages some request held and gave back
    reused = 0
    for _ in range(steps):
        batch = sched.step(sampled)
        if batch is None:
            break
        owned = set(sched.page_owners())
        freed |= held - owned
        reused += len((owned - held) & freed)
        held = owned
        sources = {src for src, _ in batch.extras["kv_page_moves"]}
        decoder.poison_pages(set(range(num_pages)) - owned - sources)
        res = runner.step(batch)
        sampled = res.sampled.cpu().tolist()
        rows = res.logits.float().cpu()
        for r, (req, samples) in enumerate(zip(batch.requests, batch.extras["sample_rows"],
                                               strict=True)):
            if samples:
                logits[(req.req_id, req.context_len)] = rows[r]
    return sched.finished_sequences(), {**vars(sched.stats), "reused_pages": reused}, logits


def assert_equals_generate(model: Any, done: dict[int, tuple[list[int], list[int]]],
                           logits: Logits, device: str, tol: float = 1e-4) -> None:
    """Every finished request's generated tokens equal the model's own greedy
    ``generate()`` from its prompt (its dense cache), and every sampled step's logits the
    dense forward's at the position they predict (float32, ``tol``)."""
    checked = 0
    for req, (prompt, generated) in sorted(done.items()):
        ids = torch.tensor([prompt], device=device)
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=len(generated), min_new_tokens=len(generated),
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert generated == want, (req, len(prompt))
        full = torch.tensor([prompt + generated], device=device)
        with torch.no_grad():
            dense = model(full).logits[0].float().cpu()
        for pos in range(len(prompt), len(prompt) + len(generated)):
            torch.testing.assert_close(logits[(req, pos)], dense[pos - 1], rtol=tol, atol=tol)
            checked += 1
    assert checked == sum(len(g) for _, g in done.values())
