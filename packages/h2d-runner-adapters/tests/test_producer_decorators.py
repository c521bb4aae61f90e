"""Every adapter method that writes a pinned source goes through ``@h2d_producer``.

The spec: sampling, input IDs, query prefixes, speculative indices and the attention
producers declare their source groups with ``@h2d_producer("group", ...)``, whose check of
the slot and epoch runs before the producer. A producer without it still works in a
well-behaved runner, so no other suite notices the decorator going missing; these do:

* every public callable of every adapter class ``h2d_runner_adapters`` exports is either
  marked as a producer (the decorator's public ``h2d_groups`` attribute) or named in
  ``NOT_PRODUCERS`` with the reason it writes no source. A new public method is neither
  until someone decides, so an undecorated new producer fails here;
* every group an adapter's pinned buffers belong to is named by one of its decorated
  producers (resolved on a built adapter): a producer decorated with the wrong group, or a
  buffer group no producer declares, fails;
* every decorated producer has a world in ``producer_families.py`` (or, for the token
  producers and ``MhaDecodeInputs.prepare``, in ``test_token_producers_rules.py``), so
  the reentry and epoch rules run on it.
"""

from __future__ import annotations

import inspect
from typing import Any

from producer_families import FAMILIES, bound, state
from test_token_producers_rules import ENTRIES as TOKEN_ENTRIES

import h2d_runner_adapters
from h2d_core import H2DBuffer
from h2d_runner_adapters import MhaDecodeInputs, StepShape, TokenInputs

#: public adapter callables that write no pinned source (by the qualname of the function
#: that defines them, so an override in a subclass is decided again), and why
NOT_PRODUCERS: dict[str, str] = {
    "DecodeStepInputs.from_adapters": "composes adapters the caller declared; before bind",
    "PrefillStepInputs.from_adapters": "composes adapters the caller declared; before bind",
    "PagedInputs.tables": "property: the block-table state, created on first use",
    "MhaDecodeInputs.step_spec": "declaration: the adapter's part of a step, a record",
    "MlaDecodeInputs.step_spec": "declaration: the adapter's part of a step, a record",
    "PrefillInputs.step_spec": "declaration: the adapter's part of a step, a record",
    "TokenInputs.verify_spec": "declaration: the verification indices' part of a step",
    "PrefillInputs.run_chunk": "a producer entry's body: refused unless an entry of "
                               "prefill_inputs is open this epoch (EpochError)",
    "TokenInputs.producer_groups": "property: the names of the token producer groups",
    "TokenInputs.fuse_assembly": "declares a fused consumer before bind; writes no source",
    "MhaDecodeInputs.request_layouts": "builds layout passes over the sources; the "
                                       "decorated fused step runs them",
    "PrefillInputs.request_layouts": "builds layout passes over the sources; the "
                                     "decorated fused step runs them",
    "MhaDecodeInputs.mrope_planes": "a view of the published MRoPE destination",
    "PrefillInputs.mrope_planes": "a view of the published MRoPE destination",
    "MhaDecodeInputs.select_mrope_positions": "first consumer: device kernel on destinations",
    "MhaDecodeInputs.generate_kv_indices": "first consumer: device kernel on destinations",
    "PrefillInputs.prepare_attention": "first consumer: device kernel on destinations",
    "PrefillStepInputs.prepare_attention": "first consumer: device kernel on destinations",
    "SamplingInputs.sample": "first consumer: device kernel on destinations",
    "TokenInputs.assemble": "first consumer: device kernel on destinations",
    "TokenInputs.gather_drafts": "first consumer: device kernel on destinations",
    "GdnStateInputs.gather_states": "first consumer: device kernel on destinations",
    "EngramInputs.write_tentative": "first consumer: writes the device history",
    "EngramInputs.commit": "first consumer: writes the device cursors",
    "MhaDraftLoop.advance": "draft steps: device kernels into the loop's device buffers",
    "V41MetadataInputs.generate_prefill_indptrs": "first consumer: device kernel",
    "V41MetadataInputs.generate_step_indptrs": "first consumer: device kernel",
    "V41MetadataInputs.write_decode_window_indices": "first consumer: device kernel",
    "V41MetadataInputs.write_prefill_indices": "first consumer: device kernel",
}


def _adapter_classes() -> list[type]:
    """The exported classes built over an H2DRunnerState, directly or through another
    adapter (MhaDraftLoop takes the decode and token adapters)."""
    classes = {n: getattr(h2d_runner_adapters, n) for n in h2d_runner_adapters.__all__}
    classes = {n: c for n, c in classes.items() if inspect.isclass(c)}
    found: set[str] = set()
    while True:
        more = {n for n, c in classes.items() if n not in found and any(
            str(p.annotation) in {"H2DRunnerState", *found}
            for p in inspect.signature(c.__init__).parameters.values())}
        if not more:
            return [classes[n] for n in sorted(found)]
        found |= more


def _public_callables(cls: type) -> dict[str, Any]:
    """name -> the attribute as the class holds it (functions, properties, class and
    static methods, the decorator's wrappers), inherited ones included."""
    out = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        raw = next(vars(k)[name] for k in cls.__mro__ if name in vars(k))
        if isinstance(raw, property) or callable(raw) or isinstance(raw, (classmethod,
                                                                             staticmethod)):
            out[name] = raw
    return out


def _function(raw: Any) -> Any:
    if isinstance(raw, property):
        return raw.fget
    return getattr(raw, "__func__", raw)


def _producers(cls: type) -> dict[str, Any]:
    return {n: f for n, f in _public_callables(cls).items()
            if hasattr(_function(f), "h2d_groups")}


def test_the_walk_sees_every_adapter_and_producer() -> None:
    """The walk itself: it finds the adapters and the decorated producers it must (a walk
    that found nothing would pass every rule below)."""
    names = {c.__name__ for c in _adapter_classes()}
    assert {"SamplingInputs", "TokenInputs", "MhaDecodeInputs", "MlaDecodeInputs",
            "PrefillInputs", "PrefillStepInputs", "DecodeStepInputs", "MlaDecodeStepInputs",
            "TokenStepInputs", "V41MetadataInputs", "GdnStateInputs", "EngramInputs",
            "MhaDraftLoop"} <= names, names
    assert "ScheduledBatch" not in names and "DecodePlan" not in names
    assert hasattr(MhaDecodeInputs.prepare, "h2d_groups")
    assert not hasattr(MhaDecodeInputs.generate_kv_indices, "h2d_groups")


def test_every_public_adapter_method_is_a_producer_or_says_why_not() -> None:
    undecided, stale = [], set(NOT_PRODUCERS)
    for cls in _adapter_classes():
        for name, raw in _public_callables(cls).items():
            fn = _function(raw)
            qualname = fn.__qualname__
            if hasattr(fn, "h2d_groups"):
                assert qualname not in NOT_PRODUCERS, f"{qualname} is decorated now"
                continue
            stale.discard(qualname)
            if qualname not in NOT_PRODUCERS:
                undecided.append(f"{cls.__name__}.{name} ({qualname})")
    assert not undecided, (
        f"public adapter methods neither decorated with @h2d_producer nor listed in "
        f"NOT_PRODUCERS: {undecided}; a method that writes a pinned source must be a "
        "producer")
    assert not stale, f"NOT_PRODUCERS names methods that are gone: {sorted(stale)}"


def _buffer_groups(adapter: Any, seen: set[int] | None = None) -> set[str]:
    """The groups of the pinned buffers the adapter (and the adapters it composes) holds."""
    seen = set() if seen is None else seen
    if id(adapter) in seen:
        return set()
    seen.add(id(adapter))
    groups = set()
    for value in vars(adapter).values():
        if isinstance(value, H2DBuffer):
            groups.add(value.group)
        elif hasattr(value, "h2d_state") and not isinstance(value, type):
            groups |= _buffer_groups(value, seen)
    return groups


def _declared_groups(adapter: Any) -> set[str]:
    out = set()
    for raw in _producers(type(adapter)).values():
        for g in _function(raw).h2d_groups:
            out.add(g(adapter) if callable(g) else g)
    return out


def _token_and_decode() -> list[Any]:
    st = state()
    tokens = TokenInputs(st, max_reqs=4, max_tokens=8, max_drafts=2)
    decode = MhaDecodeInputs(st,
                             StepShape(max_reqs=4, max_tokens=8, max_pages_per_req=4, page_size=4,
                                       num_pages=64))
    bound(st)
    return [tokens, decode]


def test_every_buffer_group_of_an_adapter_is_declared_by_its_producers() -> None:
    adapters = [fam.build() for fam in FAMILIES.values()] + _token_and_decode()
    assert {type(a) for a in adapters} >= {c for c in _adapter_classes() if _producers(c)}
    for adapter in adapters:
        buffers, declared = _buffer_groups(adapter), _declared_groups(adapter)
        assert buffers, type(adapter).__name__
        assert buffers <= declared, (
            f"{type(adapter).__name__}: buffer groups {sorted(buffers - declared)} are "
            f"written by no decorated producer (declared: {sorted(declared)})")


def test_every_decorated_producer_has_a_reentry_world() -> None:
    # the token-rules table names TokenInputs' producers by their method alone
    covered = set(FAMILIES) | {e if "." in e else f"TokenInputs.{e}" for e in TOKEN_ENTRIES}
    for cls in _adapter_classes():
        for name, raw in _producers(cls).items():
            entry = _function(raw).__qualname__
            assert entry in covered, (
                f"{cls.__name__}.{name} ({entry}) has no world in producer_families.py: "
                "add one so the reentry and epoch rules run on it")
