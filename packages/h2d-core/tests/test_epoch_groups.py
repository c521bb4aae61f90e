"""What one epoch produced and published (``state.groups``): publish callbacks of a producer
group that two combined groups carry."""

from __future__ import annotations

import torch

from h2d_core import H2DRunnerState


def _state() -> tuple[H2DRunnerState, dict[str, object]]:
    """``tokens`` rides in ``decode`` (its sources' home: declared first) and in
    ``prefill``, at a different member index in each (``decode`` has two members of its
    own before it, ``prefill`` one)."""
    st = H2DRunnerState("cpu", backend="packed")
    bufs = {name: st.buffer(name, (8,), torch.int32, group=group)
            for name, group in (("x1", "decode_only"), ("x2", "decode_only"),
                                ("y", "prefill_only"), ("a", "tokens"), ("b", "tokens"))}
    st.combine("decode", ["decode_only", "tokens"])
    st.combine("prefill", ["prefill_only", "tokens"])
    st.bind()
    return st, bufs


def test_a_callback_runs_when_the_other_combined_group_carried_its_buffer() -> None:
    st, bufs = _state()
    b = bufs["b"]
    assert b.homes[0][1] != b.homes[1][1], "the test needs b at other indices"
    ran: list[str] = []
    for sent in (True, False):
        st.begin()
        st.set_count(bufs["y"], 2)
        st.set_count(bufs["a"], None if sent else 3)
        st.set_count(b, 4 if sent else None)
        st.on_publish(b, lambda sent=sent: ran.append(f"sent={sent}"))
        st.publish("prefill")
        st.finish()
    # only_if_sent: the epoch that carried b runs it, the one that left b out does not
    assert ran == ["sent=True"]


def test_a_callback_runs_once_and_never_after_a_reopen() -> None:
    st, bufs = _state()
    ran: list[int] = []
    st.begin()
    st.set_count(bufs["x1"], 1)
    st.set_count(bufs["a"], 2)
    st.on_publish(bufs["a"], lambda: ran.append(1), only_if_sent=False)
    st.publish("decode")
    assert ran == [1]
    st.reopen("tokens", "test: a second publication")
    st.set_count(bufs["x1"], 1)
    st.set_count(bufs["a"], 2)
    st.publish("decode")
    st.finish()
    assert ran == [1], "a reopened group's callback ran again"
