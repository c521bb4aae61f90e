"""ATOM-style steps of the speculative and DeepSeek-V4 families, on the primitives of
:mod:`peers.atom_style` (source sets, the full-width per-row rebuild, one copy per field).

* :class:`MtpVerifyStep`: an MHA+MTP verify step of ``k`` drafts (q = k + 1 tokens per
  request; catalog §3d): the plain-MHA ten and the verify trio, 13 copies; for GDN+MTP
  the GDN builder's second query prefix and the spec state indices too (15), the block
  table rebuilt a second time (GDN's own ``prepare_block_tables``, catalog §4), one
  blocking scalar store per request into ``num_accepted_tokens`` and the ``.item()``
  readback of the spec token count (catalog §2.5, §8). The KV slots are computed the way
  the catalog says ATOM's MTP path does: a Python comprehension over the page lists.
* :class:`V4DecodeStep`: a DeepSeek-V4 fp8 decode step of one token per request (catalog
  §2.4 / §3c): positions, query prefix, lengths, full-width rows, state slots, four plans,
  batch ids, committed counts, three host cumsums, the per-token committed counts and
  block-table gather, the HCA index head, ``qo_indptr`` and the token core: 23 copies.

Both own their device destinations: their values are not consumed by a model here, only
their host work, copies and bytes are ATOM's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .atom_style import AtomStyleError, Field, SourceSets, copy_fields, rebuild_block_tables

__all__ = ["MtpVerifyStep", "V4DecodeStep"]

I32, I64, F32 = torch.int32, torch.int64, torch.float32


class _OwnDestinations:
    """Source sets plus same-shape device destinations (zeros, or a fill value)."""

    def __init__(self, fields: dict[str, Field], device: str | torch.device,
                 num_sets: int, fills: dict[str, float] | None = None) -> None:
        self.sources = SourceSets(fields, device, num_sets)
        self.dests = {name: torch.zeros(shape, dtype=dt, device=device)
                      for name, (dt, shape) in fields.items()}
        for name, value in (fills or {}).items():  # sentinels, staged once at init
            self.sources.fill(name, value)
            self.dests[name].fill_(value)
        self.last_bytes = 0

    @property
    def last_wait_ns(self) -> int:
        return self.sources.last_wait_ns

    def _copy(self, counts: dict[str, int]) -> None:
        self.last_bytes = copy_fields(self.sources.host, self.dests, counts)



class MtpVerifyStep(_OwnDestinations):
    """The host side of an ATOM-style MTP verify step (see the module docstring) for up to
    ``max_reqs`` requests of ``k + 1`` tokens, rows of ``max_pages`` pages."""

    def __init__(self, max_reqs: int, k: int, max_pages: int, page_size: int,
                 device: str | torch.device, gdn: bool = False, num_sets: int = 2) -> None:
        r, t = max_reqs, max_reqs * (k + 1)
        fields: dict[str, Field] = {
            "temperatures": (F32, (r,)), "input_ids": (I32, (t,)),
            "decode_cu": (I32, (r + 1,)), "decode_src": (I32, (r,)),
            "slot_mapping": (I64, (t,)), "context_lens": (I32, (r,)),
            "cu_seqlens_q": (I32, (r + 1,)), "block_tables": (I32, (r, max_pages)),
            "kv_indptr": (I32, (r + 1,)), "positions": (I64, (t,)),
        }
        if gdn:
            fields |= {"gdn_cu_seqlens_q": (I32, (r + 1,)),
                       "spec_state_indices": (I32, (r, k + 1))}
        fields |= {"target_logits_indices": (I64, (r * k,)),
                   "cu_num_draft_tokens": (I32, (r,)), "bonus_logits_indices": (I64, (r,))}
        super().__init__(fields, device, num_sets)
        self.max_reqs, self.k, self.gdn, self.page_size = r, k, gdn, page_size
        self.num_accepted = torch.ones(r, dtype=I32, device=device)

    def step(self, batch: Any, lists: Sequence[Sequence[int]]) -> int:
        """One verify step of ``batch`` (a ``ScheduledBatch`` of ``k + 1`` tokens per
        request; its ``context_lens`` include them), ``lists`` each request's pages.
        Returns the ns it waited for a free source set (a runner's hook leaves it out)."""
        cols = batch.columns
        n, k, ps = cols.context_lens.size, self.k, self.page_size
        q = k + 1
        if n > self.max_reqs or len(lists) != n:
            raise AtomStyleError(f"{n} requests, {len(lists)} page lists: the step holds "
                                 f"{self.max_reqs} requests, one list each")
        if (cols.query_lens != q).any() or cols.token_ids.size != n * q:
            raise AtomStyleError(f"the ATOM-style verify step models {q} tokens per request "
                                 f"(k = {k}); got query lengths {cols.query_lens.tolist()} and "
                                 f"{cols.token_ids.size} token ids")
        a = self.sources.acquire()
        t = n * q
        ctx = cols.context_lens.astype(np.int64)
        a["temperatures"][:n] = cols.temperatures
        a["input_ids"][:t] = cols.token_ids
        a["decode_cu"][: n + 1] = np.arange(n + 1) * q
        a["decode_src"][:n] = cols.prev_sample_rows
        bt = a["block_tables"]
        rebuild_block_tables(bt, lists)
        # ATOM's MTP slots: a Python comprehension over each request's pages (O(sum q))
        a["slot_mapping"][:t] = [row[p // ps] * ps + p % ps
                                 for row, c in zip(lists, ctx.tolist(), strict=True)
                                 for p in range(c - q, c)]
        a["context_lens"][:n] = ctx
        a["cu_seqlens_q"][: n + 1] = np.arange(n + 1) * q
        a["kv_indptr"][0] = 0
        np.cumsum(-(-ctx // ps), out=a["kv_indptr"][1 : n + 1])
        a["positions"][:t] = (ctx[:, None] - q + np.arange(q)[None, :]).reshape(-1)
        if self.gdn:
            rebuild_block_tables(bt, lists)  # GDN's prepare_gdn_metadata rebuilds it again
            a["gdn_cu_seqlens_q"][: n + 1] = a["cu_seqlens_q"][: n + 1]
            a["spec_state_indices"][:n] = np.arange(n)[:, None] * q + np.arange(q)[None, :]
        starts = np.arange(n) * q
        a["target_logits_indices"][: n * k] = (starts[:, None] + np.arange(k)).reshape(-1)
        a["cu_num_draft_tokens"][:n] = np.arange(1, n + 1) * k
        a["bonus_logits_indices"][:n] = starts + k
        counts = {name: n + 1 if name in ("decode_cu", "cu_seqlens_q", "kv_indptr",
                                          "gdn_cu_seqlens_q")
                  else t if name in ("input_ids", "slot_mapping", "positions")
                  else n * k if name == "target_logits_indices" else n
                  for name in self.dests}
        self._copy(counts)
        if self.gdn:
            self.num_accepted.fill_(1)
            for i in range(n):  # one blocking scalar store per request
                self.num_accepted[i] = 1 + (i % q)
            self.dests["gdn_cu_seqlens_q"][n].item()  # the spec token count read back
        self.sources.release()
        return self.last_wait_ns


class V4DecodeStep(_OwnDestinations):
    """The host side of an ATOM-style DeepSeek-V4 fp8 decode step (see the module
    docstring) for up to ``max_reqs`` requests of one token, rows of ``max_blocks``
    256-token blocks; ``window`` (SWA), ``index_topk`` and ``envelope_rows`` as the
    model's."""

    RATIOS = ((4, 8), (128, 128))  # (compress ratio, K: 2r when overlapping, else r)

    def __init__(self, max_reqs: int, max_blocks: int, device: str | torch.device, *,
                 window: int, index_topk: int, envelope_rows: int, num_sets: int = 2) -> None:
        r = max_reqs  # T_dec = S * (1 + k) with k = 0; N = S tokens
        hca_cap = r * (window + 2 * max_blocks)  # T_dec * (W + max_model_len // 128)
        fields: dict[str, Field] = {  # in ATOM's upload order: the token core first
            "temperatures": (F32, (r,)), "input_ids": (I32, (r,)),
            "decode_cu": (I32, (r + 1,)), "decode_src": (I32, (r,)),
            "positions": (I64, (r,)), "cu_seqlens_q": (I32, (r + 1,)),
            "context_lens": (I32, (r,)), "block_tables": (I32, (r, max_blocks)),
            "slot_out": (I32, (r,)), "slot_in": (I32, (r,)),
        }
        for ratio, k in self.RATIOS:
            fields[f"compress_{ratio}"] = (I32, (r // ratio + r, 4))
            fields[f"write_{ratio}"] = (I32, (min(r, r * k), 4))
        fields |= {
            "batch_id": (I32, (r,)), "ncsa": (I32, (r,)),
            "ind_swa": (I32, (r + 1,)), "ind_csa": (I32, (r + 1,)),
            "n_committed": (I32, (r,)), "bt_per_token": (I32, (r, max_blocks)),
            "ind_hca": (I32, (r + 1,)), "hca_idx": (I32, (hca_cap,)),
            "qo_indptr": (I32, (r + 1,)),
        }
        plans: dict[str, float] = {f"{kind}_{ratio}": -1 for ratio, _ in self.RATIOS
                                   for kind in ("compress", "write")}
        super().__init__(fields, device, num_sets, fills=plans)
        self.max_reqs, self.window = r, window
        self.index_topk, self.envelope_rows = index_topk, envelope_rows

    def step(self, spans: Any, lists: Sequence[Sequence[int]]) -> int:
        """One decode step of ``spans`` (``SpanColumns``: one token per request),
        ``lists`` each request's blocks. Returns the ns it waited for a free source set."""
        n = spans.context_lens.size
        if n > self.max_reqs or len(lists) != n:
            raise AtomStyleError(f"{n} requests, {len(lists)} page lists: the step holds "
                                 f"{self.max_reqs} requests, one list each")
        if n and int(spans.query_lens.max()) != 1:
            raise AtomStyleError("the ATOM-style V4 step models one token per request")
        a = self.sources.acquire()
        ctx = spans.context_lens.astype(np.int64)
        pos = ctx - 1
        t = np.arange(n)
        a["temperatures"][:n] = 1.0
        a["input_ids"][:n] = 0
        a["decode_cu"][: n + 1] = np.arange(n + 1)
        a["decode_src"][:n] = t
        a["positions"][:n] = pos
        a["cu_seqlens_q"][: n + 1] = np.arange(n + 1)
        a["context_lens"][:n] = ctx
        bt = a["block_tables"]
        rebuild_block_tables(bt, lists)
        a["slot_out"][:n] = spans.state_slots_out
        a["slot_in"][:n] = spans.state_slots_in
        for ratio, k in self.RATIOS:  # rows [t, batch, position, window_len], -1 past them
            rows = np.stack([t, t, pos, np.full(n, k - 1)], axis=1)
            sel = np.flatnonzero((pos + 1) % ratio == 0)  # the compress boundaries
            plan = a[f"compress_{ratio}"]
            plan[: sel.size] = rows[sel]
            plan[sel.size : n] = -1
            a[f"write_{ratio}"][:n] = rows  # q = 1: every token is in its last K
        a["batch_id"][:n] = t
        ncsa = ctx // 4
        a["ncsa"][:n] = ncsa
        swa = np.minimum(pos + 1, self.window)
        vis = np.minimum((pos + 1) // 4, ncsa)
        hca = ctx // 128
        for name, seg in (("ind_swa", swa), ("ind_csa", swa + np.minimum(vis, self.index_topk)),
                          ("ind_hca", swa + hca)):
            a[name][0] = 0
            np.cumsum(seg, out=a[name][1 : n + 1])
        a["n_committed"][:n] = vis
        per_token = a["bt_per_token"]
        per_token[:n] = 0  # the mqa rows zeroed, then each owned row gathered
        per_token[t] = bt[t]
        head, ptr, env = a["hca_idx"], a["ind_hca"], self.envelope_rows
        for i in range(n):  # HCA index head: compressed rows, then -1 for the window tail
            e = np.arange(int(hca[i]))
            start = int(ptr[i])
            head[start : start + e.size] = bt[i, e // 2] * env + e % 2
            head[start + e.size : int(ptr[i + 1])] = -1
        a["qo_indptr"][: n + 1] = np.arange(n + 1)
        prefixes = ("cu_seqlens_q", "ind_swa", "ind_csa", "ind_hca", "qo_indptr", "decode_cu")
        counts = {name: int(ptr[n]) if name == "hca_idx" else n + 1 if name in prefixes else n
                  for name in self.dests}
        self._copy(counts)
        self.sources.release()
        return self.last_wait_ns
