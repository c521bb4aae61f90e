"""The arrays a :class:`~h2d_core.RequestLayout` writes, checked once when it is built,
and the request and token capacities they give.

Plain Python, run at construction (nothing per step): a bad array or scalar is refused
with a :class:`~h2d_core.errors.RequestLayoutError` naming the layout and the argument.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .errors import RequestLayoutError, describe_value

INT32_MAX = 2**31 - 1

#: every array a layout may write: (argument, dtype, dimensions)
LAYOUT_ARRAYS = (
    ("table", np.int32, 2),
    ("required_pages", np.int32, 1),
    ("positions", np.int64, 1),
    ("slot_mapping", np.int64, 1),
    ("token_requests", np.int32, 1),
    ("cu_query", np.int32, 1),
    ("kv_page_indptr", np.int32, 1),
    ("context_lens", np.int32, 1),
    ("token_prefix", np.int32, 1),
    ("last_page_lens", np.int32, 1),
    ("context_prefix", np.int32, 1),
)
#: the arrays of ``requests + 1`` entries, of ``requests`` entries and of ``tokens`` entries
_REQUEST_PREFIXES = ("cu_query", "kv_page_indptr", "context_prefix")
_PER_REQUEST = ("context_lens", "last_page_lens")
_PER_TOKEN = ("positions", "slot_mapping", "token_requests")


class LayoutArrays(NamedTuple):
    """A layout's arrays, checked: the bound ones by name (``cu_query``'s extra copies as
    ``cu_query[k]``), the query prefix and its copies, and the capacities each array gives
    (the layout holds the smallest of each)."""

    arrays: dict[str, np.ndarray]
    cu_query: np.ndarray | None
    copies: tuple[np.ndarray, ...]
    req_caps: list[int]
    tok_caps: list[int]


def checked_array(name: str, what: str, value: Any, dtype: Any, ndim: int) -> Any:
    """``value`` if it is a C-contiguous writeable array of ``dtype`` and ``ndim``."""
    if value is None:
        return None
    if (not isinstance(value, np.ndarray) or value.dtype != dtype or value.ndim != ndim
            or not value.flags.c_contiguous or not value.flags.writeable):
        raise RequestLayoutError(
            f"{name}: {what} must be a writeable C-contiguous {ndim}-D "
            f"{np.dtype(dtype).name} array, got {describe_value(value)}"
        )
    return value


def layout_arrays(name: str, page_size: object, context_cap: object,
                  given: dict[str, Any]) -> LayoutArrays:
    """Check layout ``name``'s ``page_size``, ``context_cap`` and arrays (``given``: each
    of :data:`LAYOUT_ARRAYS` by argument name, None when not written; ``cu_query`` may be
    a tuple of arrays, the same prefix going to each)."""
    given = dict(given)
    copies: tuple = ()
    cu_query = given["cu_query"]
    if isinstance(cu_query, tuple):
        copies = tuple(checked_array(name, f"cu_query[{k}]", a, np.int32, 1)
                       for k, a in enumerate(cu_query))
        given["cu_query"] = copies[0] if copies else None
        copies = copies[1:]
    if type(page_size) is not int or not 1 <= page_size <= INT32_MAX:
        raise RequestLayoutError(
            f"{name}: page_size must be an int in [1, 2**31), got {page_size!r}")
    arrays = {key: checked_array(name, key, given[key], dtype, ndim)
              for key, dtype, ndim in LAYOUT_ARRAYS}
    if context_cap is not None and (type(context_cap) is not int
                                    or not 1 <= context_cap <= INT32_MAX):
        raise RequestLayoutError(
            f"{name}: context_cap must be None or an int in [1, 2**31), got {context_cap!r}")
    token_prefix = arrays["token_prefix"]
    if token_prefix is not None and token_prefix.size < 1:
        raise RequestLayoutError(
            f"{name}: token_prefix needs at least 1 entry (tokens + 1), got "
            f"{describe_value(token_prefix)}")
    table, required = arrays["table"], arrays["required_pages"]
    if (table is None) != (required is None) or (table is None and (
            arrays["slot_mapping"] is not None or arrays["kv_page_indptr"] is not None)):
        raise RequestLayoutError(
            f"{name}: table and required_pages go together, and slot_mapping and "
            "kv_page_indptr need them; pass both (a paged layout) or neither")
    bound = {k: v for k, v in arrays.items() if v is not None}
    req_caps = [table.shape[0], required.size] if table is not None else []
    req_caps += [bound[key].size - 1 for key in _REQUEST_PREFIXES if key in bound]
    for k, a in enumerate(copies, 1):
        bound[f"cu_query[{k}]"] = a
        req_caps.append(a.size - 1)
    req_caps += [bound[key].size for key in _PER_REQUEST if key in bound]
    tok_caps = [bound[key].size for key in _PER_TOKEN if key in bound]
    if token_prefix is not None:
        tok_caps.append(token_prefix.size - 1)
    return LayoutArrays(bound, arrays["cu_query"], copies, req_caps, tok_caps)
