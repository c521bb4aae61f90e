"""Decode HCA visibility is per token: a verify step's tokens before a closing rate-128
window do not see the entry it closes (``min((p + 1) // 128, ctx // 128)``, as in prefill).

Step indptr generation and the per-token expansion against their plain-Python references
and against lengths written out by hand; and the refusal of a bad ``window`` (which
selects the prefill window-write rows).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from h2d_runner_adapters.v4.step_indptrs import (
    StepIndptrs,
    expand_v4_token_tables,
    expand_v4_token_tables_reference,
    generate_v4_step_indptrs,
    generate_v4_step_indptrs_reference,
)

WINDOW, TOPK, ENVELOPE, WIDTH = 4, 8, 3, 2


def test_verify_tokens_see_only_the_hca_entries_of_their_position(dev: torch.device) -> None:
    # request 0 verifies positions 126..129 (window 0 closes at 127), request 1 254..257
    # (window 1 closes at 255); then one padded token
    positions = [126, 127, 128, 129, 254, 255, 256, 257, 0]
    bids = [0, 0, 0, 0, 1, 1, 1, 1, -1]
    seq_lens = [130, 258]
    tables = [[7, 9], [4, 5]]
    t, n = len(positions), len(seq_lens)

    def buf(k: int) -> torch.Tensor:
        return torch.full((k,), -7, dtype=torch.int32, device=dev)

    out = StepIndptrs(buf(t + 1), buf(t + 1), buf(t + 1), buf(t), buf(n))
    pos = torch.tensor(positions, dtype=torch.int64, device=dev)
    ids = torch.tensor(bids, dtype=torch.int32, device=dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    generate_v4_step_indptrs(pos, ids, lens, out, num_tokens=t, num_reqs=n, padded_reqs=n,
                             window=WINDOW, index_topk=TOPK)
    hca = out.hca_indptr.cpu().tolist()
    # each token: the window (4), plus the entries closed at or before its position
    assert [b - a - WINDOW for a, b in itertools.pairwise(hca[:-1])] == [
        0, 1, 1, 1, 1, 2, 2, 2]
    ref = generate_v4_step_indptrs_reference(positions, bids, seq_lens, num_reqs=n,
                                             padded_reqs=n, window=WINDOW, index_topk=TOPK)
    assert hca == ref["hca_indptr"]
    per_token = torch.zeros(t, WIDTH, dtype=torch.int32, device=dev)
    cells = torch.full((hca[-1] + 4,), -7, dtype=torch.int32, device=dev)
    expand_v4_token_tables(pos, ids, lens, torch.tensor(tables, dtype=torch.int32, device=dev),
                           out.hca_indptr, per_token, cells, num_tokens=t, num_reqs=n,
                           window=WINDOW, envelope_rows=ENVELOPE)
    _, want = expand_v4_token_tables_reference(positions, bids, seq_lens, tables, hca, WIDTH,
                                               ENVELOPE)
    got = cells.cpu().tolist()
    assert got[: hca[-1]] == want and got[hca[-1]:] == [-7] * 4
    # the token at 126 has no compressed head; the one at 254 only entry 0 (block 4, row 0)
    assert got[:WINDOW] == [-1] * WINDOW
    assert got[hca[4]:hca[5]] == [4 * ENVELOPE + 0] + [-1] * WINDOW
    assert got[hca[5]:hca[6]] == [4 * ENVELOPE + 0, 4 * ENVELOPE + 1] + [-1] * WINDOW


def test_a_window_that_is_not_a_positive_int_is_refused_before_any_declaration() -> None:
    """``window`` sizes the prefill window-write rows and selects them: a bool, a float or
    a count below 1 is refused (naming the group and the rule) before any buffer of the
    group is declared."""
    from h2d_core import DeclarationError, H2DRunnerState
    from h2d_runner_adapters import V41MetadataInputs

    for bad in (0, -3, True, 8.0):
        st = H2DRunnerState("cpu", backend="direct", num_slots=1)
        with pytest.raises(DeclarationError, match=r"ub0_v41_metadata: window must be an int"):
            V41MetadataInputs(st, max_reqs=2, max_tokens=8, max_blocks_per_req=2,
                              dummy_state_slot=9, dummy_block=5, window=bad, prefix="ub0_")
        assert not st.buffers(), bad
