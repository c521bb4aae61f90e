"""Host cost of the individual CUDA calls one publication epoch makes (median ns).

Measures each call the packed decode step issues per step, through torch and through
ctypes, so the per-step host budget can be split into what Python costs and what the
CUDA runtime/driver costs on this host.

    python tools/perf/cuda_call_costs.py
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch


def bench(fn, n: int = 20000) -> float:
    for _ in range(500):
        fn()
    pc = time.perf_counter_ns
    out = []
    for _ in range(n):
        t = pc()
        fn()
        out.append(pc() - t)
    return float(np.median(out))


def main() -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    s = torch.cuda.current_stream()
    raw = s.cuda_stream
    ev = torch.cuda.Event()
    ev.record(s)
    torch.cuda.synchronize()
    lib = ctypes.CDLL("libcuda.so.1")
    is_cap = lib.cuStreamIsCapturing
    is_cap.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    is_cap.restype = ctypes.c_int
    st = ctypes.c_int(0)
    ref = ctypes.byref(st)
    ev_rec = lib.cuEventRecord
    ev_rec.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    ev_rec.restype = ctypes.c_int
    ev_q = lib.cuEventQuery
    ev_q.argtypes = [ctypes.c_void_p]
    ev_q.restype = ctypes.c_int
    g = torch.cuda.CUDAGraph()
    x = torch.zeros(16, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(s)
    with torch.cuda.stream(side):
        x.add_(1)
        g.capture_begin()
        x.add_(1)
        g.capture_end()
    s.wait_stream(side)
    torch.cuda.synchronize()
    exec_ = int(g.raw_cuda_graph_exec())
    launch = lib.cuGraphLaunch
    launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    launch.restype = ctypes.c_int
    ev_handle = ev.cuda_event
    rows = {
        "torch._C._cuda_getDevice()": lambda: torch._C._cuda_getDevice(),
        "torch._C._cuda_getCurrentRawStream(0)": lambda: torch._C._cuda_getCurrentRawStream(0),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "Event.record(stream)": lambda: ev.record(s),
        "Event.synchronize() (done)": lambda: ev.synchronize(),
        "Event.query() (done)": lambda: ev.query(),
        "ctypes cuStreamIsCapturing": lambda: is_cap(raw, ref),
        "ctypes cuEventRecord": lambda: ev_rec(ev_handle, raw),
        "ctypes cuEventQuery": lambda: ev_q(ev_handle),
        "ctypes cuGraphLaunch (tiny graph)": lambda: launch(exec_, raw),
        "CUDAGraph.replay() (tiny graph)": lambda: g.replay(),
        "empty python call": lambda: None,
    }
    for name, fn in rows.items():
        print(f"{bench(fn) / 1e3:7.2f} µs  {name}", flush=True)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
