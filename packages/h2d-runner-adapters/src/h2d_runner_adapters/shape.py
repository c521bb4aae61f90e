"""The step's capacities, held once: :class:`StepShape`.

Every paged adapter (:class:`MhaDecodeInputs`, :class:`MlaDecodeInputs`,
:class:`PrefillInputs`, the fused :class:`DecodeStepInputs`, :class:`MlaDecodeStepInputs`
and :class:`PrefillStepInputs`, and their base :class:`PagedInputs`) sizes its buffers from
the same six numbers. One :class:`StepShape` carries them, checked whole when it is made,
so an engine builds it once and hands it to each adapter of a step::

    shape = StepShape(max_reqs=64, max_tokens=256, max_pages_per_req=512, page_size=16,
                      num_pages=32768)
    decode = DecodeStepInputs(state, shape)
    prefill = PrefillStepInputs(other_state, shape)

The adapters read it at construction only: nothing per step looks at it.
"""

from __future__ import annotations

from dataclasses import dataclass

from h2d_core import DeclarationError

from .checks import INT32_MAX

#: per field: the lowest and highest value allowed (None: no upper bound), whether None
#: is allowed, and what the value bounds (said when it is refused)
_RULES: dict[str, tuple[int, int | None, bool, str]] = {
    "max_reqs": (1, None, False, "the requests of one step, graph padding included"),
    "max_tokens": (1, None, False, "the tokens of one step, graph padding included"),
    "max_pages_per_req": (1, None, False, "the pages one request's block-table row holds"),
    "page_size": (1, INT32_MAX, False, "the tokens one KV page holds"),
    "num_pages": (1, INT32_MAX + 1, True, "the KV pool's pages: every page ID lies "
                                           "below it"),
    "max_ranges": (0, None, False, "the changed byte ranges of the block table one "
                                   "publication may send inside the group's DMA"),
}


def _rule_text(name: str) -> str:
    lo, hi, allow_none, _ = _RULES[name]
    span = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
    return f"None or {span}" if allow_none else span


def check_capacity(name: str, value: object, *, rule: str | None = None,
                   owner: str = "StepShape") -> None:
    """Refuse ``value`` for the capacity ``name`` unless it keeps the rule of the
    :class:`StepShape` field ``rule`` (default: ``name`` itself): an ``int`` (not a
    ``bool``) in the field's range, or None where the field allows it. Raises
    :class:`h2d_core.DeclarationError` naming ``owner``, ``name``, the rule and what to
    pass."""
    lo, hi, allow_none, bounds = _RULES[rule or name]
    if value is None and allow_none:
        return
    if (isinstance(value, bool) or not isinstance(value, int) or value < lo
            or (hi is not None and value > hi)):
        raise DeclarationError(
            f"{owner}: {name} must be {_rule_text(rule or name)}, got {value!r} (it bounds "
            f"{bounds}); pass {'None or ' if allow_none else ''}a Python int in that range")


@dataclass(frozen=True, slots=True)
class StepShape:
    """The capacities a step's adapters are declared with (checked whole when made).

    * ``max_reqs``: the most requests one step holds, graph padding included (the rows of
      the per-request buffers and of the block table); ``padded`` past it is refused.
    * ``max_tokens``: the most tokens one step holds, graph padding included (the
      per-token buffers: positions, KV slots, token ids, MRoPE planes).
    * ``max_pages_per_req``: the most KV pages one request's block-table row holds (the
      table's width); ``kv_indices`` holds ``max_reqs * max_pages_per_req`` entries.
    * ``page_size``: the tokens one KV page holds; a batch scheduled with another page
      size is refused, since KV slots are ``page * page_size + offset``. In
      ``[1, 2**31 - 1]``.
    * ``num_pages``: the KV pool's size: every page ID a row brings is checked to lie in
      ``[0, num_pages)`` before anything is written. None (the default): no pool bound,
      only that page IDs are >= 0 and fit int32. At most ``2**31``.
    * ``max_ranges``: the most changed byte ranges of the block table one publication may
      send inside the group's packed DMA (default 64); 0 sends a changed table as whole
      rows (docs/design.md "Block tables").

    Each is a plain ``int`` (a ``bool`` or a float is refused); a bad field raises
    :class:`h2d_core.DeclarationError` naming it and its rule, before any adapter
    declares a buffer.
    """

    max_reqs: int
    max_tokens: int
    max_pages_per_req: int
    page_size: int
    num_pages: int | None = None
    max_ranges: int = 64

    def __post_init__(self) -> None:
        for name in _RULES:
            check_capacity(name, getattr(self, name))


def check_shape(owner: str, shape: object) -> StepShape:
    """``shape`` when it is a :class:`StepShape`; otherwise refused naming ``owner``."""
    if not isinstance(shape, StepShape):
        raise DeclarationError(
            f"{owner}: shape must be a StepShape, got {type(shape).__name__}; build one with "
            "StepShape(max_reqs=..., max_tokens=..., max_pages_per_req=..., page_size=...)")
    return shape
