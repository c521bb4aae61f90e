"""The same producer call cold and warm: what the rest of a step costs the metadata path.

Runs the MTP runner (``tests-integration/decode_runner/mtp.py``) and, after each
iteration, calls the fused producer's ``prepare`` three more times on the batch the
iteration just prepared, in the same slot: a table hit, the same bytes, the same code
path. The first call runs after the iteration's own host work (the models' launches,
acceptance, the draft loop); the next two run right after it.

    python3 tools/perf/cold_call.py [--bs 8] [--iterations 12] [--device cpu|cuda]

On CPU the Triton kernels run in the interpreter (set here), so the iteration's host work
is far larger than on a GPU host.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from repo_paths import use_sources

    use_sources()
    import numpy as np
    import torch
    from decode_runner.mtp import MtpConfig, MtpRunner

    torch.set_num_threads(1)
    cfg = MtpConfig(num_reqs=args.bs, k=1, page_size=16, num_pages=args.bs * 200,
                    max_pages_per_req=200, initial_context=40)
    runner = MtpRunner(cfg, args.device, "packed")
    step, st = runner.step, runner.state
    seen = []
    prepare = step.prepare

    def recording(batch, *a, **k):  # type: ignore[no-untyped-def]
        seen.append(batch)
        return prepare(batch, *a, **k)

    step.prepare = recording
    pc = time.perf_counter_ns
    rows = []
    for i in range(args.iterations):
        runner.iterate()
        batch = seen[-1]
        calls = []
        for _ in range(3):
            st.begin()
            t0 = pc()
            prepare(batch)
            calls.append((pc() - t0) / 1e3)
            st.finish()
        if i >= 2:  # past compilation and the first table fills
            rows.append(calls)
            print(f"iteration {i}: prepare µs, 1st / 2nd / 3rd call after it: "
                  + " / ".join(f"{c:.1f}" for c in calls))
    med = np.median(np.array(rows), axis=0)
    print(f"median: first {med[0]:.1f} µs, then {med[1]:.1f} and {med[2]:.1f} µs "
          f"({args.device}, bs {args.bs})")


if __name__ == "__main__":
    main()
