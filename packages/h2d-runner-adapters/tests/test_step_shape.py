"""``StepShape``: the step's capacities, held once and checked whole when made.

Each field's rule is refused with :class:`h2d_core.DeclarationError` naming the field, the
rule and what to pass (0, negative, ``bool``, float, None where it is not allowed, past the
upper bound); a valid shape builds every paged adapter, which reads its capacities from it
(the buffers it declares) and publishes a step. A refused shape reaches no state, and an
adapter given something else than a ``StepShape`` is refused before declaring anything.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from block_tables import BlockTable, PageIdRangeError
from h2d_core import DeclarationError, H2DRunnerState
from h2d_runner_adapters import (
    DECODE_STEP,
    DecodeStepInputs,
    MhaDecodeInputs,
    MlaDecodeInputs,
    MlaDecodeStepInputs,
    PagedInputs,
    PrefillInputs,
    PrefillStepInputs,
    SamplingParams,
    ScheduledBatch,
    ScheduledRequest,
    StepShape,
)

VALID: dict[str, Any] = {"max_reqs": 4, "max_tokens": 8, "max_pages_per_req": 6,
                         "page_size": 16, "num_pages": 64, "max_ranges": 8}
INT32_MAX = 2**31 - 1

#: (field, bad value, the rule its message states)
BAD: list[tuple[str, object, str]] = [
    *[(name, value, r"an int >= 1")
      for name in ("max_reqs", "max_tokens", "max_pages_per_req")
      for value in (0, -1, True, False, 4.0, None, "4")],
    *[("page_size", value, r"an int in \[1, 2147483647\]")
      for value in (0, -16, True, 16.0, None, 2**31)],
    *[("num_pages", value, r"None or an int in \[1, 2147483648\]")
      for value in (0, -1, True, 64.0, 2**31 + 1)],
    *[("max_ranges", value, r"an int >= 0") for value in (-1, True, False, 8.0, None)],
]


@pytest.mark.parametrize("field, value, rule", BAD,
                         ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_each_invalid_field_is_refused_naming_it(field: str, value: object, rule: str) -> None:
    with pytest.raises(DeclarationError) as caught:
        StepShape(**{**VALID, field: value})
    message = str(caught.value)
    # the field, the rule, the value as given, what it bounds and what to do
    assert message.startswith(f"StepShape: {field} must be "), message
    assert re.search(rf"{field} must be {rule}, got ", message), message
    assert f"got {value!r} (it bounds " in message, message
    assert "a Python int in that range" in message, message


def test_each_field_names_itself_whatever_the_others() -> None:
    """The first bad field in declaration order is the one named."""
    with pytest.raises(DeclarationError, match=r"^StepShape: max_tokens must be"):
        StepShape(max_reqs=4, max_tokens=0, max_pages_per_req=0, page_size=0)
    with pytest.raises(DeclarationError, match=r"^StepShape: page_size must be"):
        StepShape(max_reqs=4, max_tokens=4, max_pages_per_req=4, page_size=True)


@pytest.mark.parametrize("field, value", [
    ("max_reqs", 1), ("max_tokens", 1), ("max_pages_per_req", 1), ("page_size", 1),
    ("page_size", INT32_MAX), ("num_pages", None), ("num_pages", 1), ("num_pages", 2**31),
    ("max_ranges", 0), ("max_ranges", 1),
])
def test_the_bounds_themselves_are_allowed(field: str, value: object) -> None:
    shape = StepShape(**{**VALID, field: value})
    assert getattr(shape, field) == value


def test_defaults_positional_order_and_the_record() -> None:
    shape = StepShape(4, 8, 6, 16)
    assert (shape.num_pages, shape.max_ranges) == (None, 64)  # today's adapter defaults
    assert shape == StepShape(max_reqs=4, max_tokens=8, max_pages_per_req=6, page_size=16)
    assert [f.name for f in dataclasses.fields(StepShape)] == list(VALID)
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.max_reqs = 5  # type: ignore[misc]
    assert not hasattr(shape, "__dict__")  # slots
    # replace() checks the new record too
    assert dataclasses.replace(shape, max_ranges=0).max_ranges == 0
    with pytest.raises(DeclarationError, match=r"^StepShape: max_ranges must be an int >= 0"):
        dataclasses.replace(shape, max_ranges=-1)


def _mla_step(st: H2DRunnerState, shape: StepShape) -> object:
    return MlaDecodeStepInputs(st, shape, index_topk=4)


ADAPTERS: dict[str, Any] = {
    "MhaDecodeInputs": MhaDecodeInputs,
    "MlaDecodeInputs": MlaDecodeInputs,
    "PrefillInputs": PrefillInputs,
    "DecodeStepInputs": DecodeStepInputs,
    "MlaDecodeStepInputs": _mla_step,
    "PrefillStepInputs": PrefillStepInputs,
    "PagedInputs": lambda st, shape: PagedInputs(st, shape, "paged", "paged_block_tables"),
}


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_every_paged_adapter_reads_its_capacities_from_the_shape(name: str) -> None:
    st = H2DRunnerState("cpu", scatter="reference")
    shape = StepShape(**VALID)
    adapter = ADAPTERS[name](st, shape)
    paged = getattr(adapter, "decode", getattr(adapter, "prefill", adapter))
    assert paged.shape is shape
    assert paged.page_size == 16 and paged.pool_limit == 64
    tables = paged.block_tables
    assert tables.spec.shape == (4, 6) and tables.max_ranges == 8
    if type(paged) is not PagedInputs:  # the adapters declare the rest of the step
        assert paged.positions.spec.shape == (8,)  # max_tokens
        assert paged.kv_indptr.spec.shape == (5,)  # max_reqs + 1
        assert paged.kv_indices.numel() == 4 * 6  # max_reqs * max_pages_per_req
    st.bind()


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_an_adapter_refuses_what_is_not_a_step_shape(name: str) -> None:
    st = H2DRunnerState("cpu", scatter="reference")
    for bad in (dict(VALID), (4, 8, 6, 16), None):
        with pytest.raises(DeclarationError, match=r": shape must be a StepShape, got "
                                                   rf"{type(bad).__name__}; build one"):
            ADAPTERS[name](st, bad)
    assert st.buffers() == {}  # refused before any buffer was declared


def test_shape_is_the_second_positional_parameter_or_a_keyword() -> None:
    st = H2DRunnerState("cpu", scatter="reference")
    shape = StepShape(**VALID)
    assert MhaDecodeInputs(st, shape=shape).shape is shape
    assert PrefillInputs(st, shape=shape, mrope=True).shape is shape
    with pytest.raises(TypeError, match="max_reqs"):
        MhaDecodeInputs(st, max_reqs=4, max_tokens=8, max_pages_per_req=6,  # type: ignore[call-arg]
                        page_size=16, prefix="old_")


def test_a_valid_shape_builds_a_working_step() -> None:
    """One shape, one fused decode step: the step publishes with the shape's page size
    and refuses a page past its pool."""
    st = H2DRunnerState("cpu", scatter="reference")
    step = DecodeStepInputs(st, StepShape(**VALID), fuse_kv_indices=False)
    st.bind()
    greedy = SamplingParams(temperature=0.0)
    batch = ScheduledBatch([
        ScheduledRequest(0, 1, 20, BlockTable([3, 7]), greedy, token_ids=[11]),
        ScheduledRequest(1, 1, 9, BlockTable([5]), greedy, token_ids=[12]),
    ], is_prefill=False, page_size=16)
    st.begin()
    plan = step.prepare(batch, padded=4)
    st.publish(DECODE_STEP)
    st.finish()
    assert step.decode.slot_mapping.gpu[:4].tolist() == [7 * 16 + 3, 5 * 16 + 8, -1, -1]
    assert plan.decode.padded_reqs == 4
    far = ScheduledBatch([ScheduledRequest(0, 1, 20, BlockTable([3, 64]), greedy,
                                           token_ids=[11])], is_prefill=False, page_size=16)
    st.begin()
    with pytest.raises(PageIdRangeError, match=r"64"):  # num_pages=64: IDs in [0, 64)
        step.prepare(far)
    st.finish()
