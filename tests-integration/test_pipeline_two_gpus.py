"""Pipeline parallelism on two GPUs: two stages as NCCL ranks, each with its own runner
slots and block-table state; the slots rotate over the in-flight microbatches; packed and
direct give bit-identical logits over 200 steps (``nox -s gpu2``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from decode_runner.pipeline import PipelineConfig, worker


@pytest.mark.gpu
def test_two_stage_pipeline_packed_equals_direct(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (nox -s gpu2 on a two-GPU machine)")
    import torch.multiprocessing as mp

    cfg = PipelineConfig()
    mp.spawn(worker, args=(cfg, f"file://{tmp_path}/rendezvous", str(tmp_path)), nprocs=2,
             join=True)
    reports = [Path(tmp_path, f"rank{r}.txt").read_text() for r in range(2)]
    print("".join(reports))
    for text in reports:
        assert "slots rotate per microbatch: False" not in text
        assert text.count("slots rotate per microbatch: True") == 2
        packed = text.splitlines()[1]
        assert f"'publications': {cfg.steps}, 'dmas': {cfg.steps}, 'scatters': {cfg.steps}" \
            in packed, packed
    assert f"bit for bit, over {cfg.steps} steps: True" in reports[1]
