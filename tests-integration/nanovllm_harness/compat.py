"""Small wrappers that let stock nano-vllm (``nano-vllm-fork==20260210``) run here, each
for one quirk of the fork; the fork's code is never edited or copied.

:func:`patch_rope` is needed wherever transformers 5 is installed. :func:`patch_for_cpu`
changes torch itself for the whole process (factories, ``Tensor.cuda``, ``torch.cuda``
calls, ``torch.distributed``'s backend, ``torch.compile``): call it only in a process
of its own (``stock_cpu.py``), before nano-vllm is imported.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable
from typing import Any


def patch_rope(qwen3: types.ModuleType) -> None:
    """Wrap the ``get_rope`` nano-vllm's Qwen3 calls (``nanovllm.models.qwen3.get_rope``).

    Quirk: under transformers 5 ``config.rope_scaling`` is the rope-parameters dict
    (``{"rope_type": "default", "rope_theta": ...}``) and ``config.rope_theta`` is gone, so
    ``models/qwen3.py`` (lines 134-135) passes base=1e6 (its default) and that dict into
    ``layers/rotary_embedding.py``'s ``lru_cache``d ``get_rope`` (lines 51-59): ``TypeError:
    unhashable type: 'dict'`` (and its ``assert rope_scaling is None`` would fail next).
    The wrapper takes ``rope_theta`` from a default-type dict as the base and passes None;
    any other rope type is refused."""
    original = qwen3.get_rope
    if getattr(original, "_h2d_rope_wrapper", False):
        return

    @functools.wraps(original)
    def get_rope(head_size: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None) -> Any:
        if isinstance(rope_scaling, dict):
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type != "default":
                raise NotImplementedError(f"nano-vllm's rotary embedding has no {rope_type!r}")
            base = float(rope_scaling.get("rope_theta", base))
            rope_scaling = None
        return original(head_size, rotary_dim=rotary_dim, max_position=max_position,
                        base=base, rope_scaling=rope_scaling)

    get_rope._h2d_rope_wrapper = True  # type: ignore[attr-defined]
    setattr(qwen3, "get_rope", get_rope)  # noqa: B010 (a module attribute)


def patch_rmsnorm_fp32(layernorm: types.ModuleType) -> None:
    """Wrap ``nanovllm.layers.layernorm.RMSNorm.forward`` for float32 only (bf16 and fp16
    run the fork's own forward untouched).

    Quirk: in float32 ``x.float()`` and ``x.to(orig_dtype)`` return ``x`` itself, so the
    in-place ``mul_``/``add_`` of ``rms_forward`` and ``add_rms_forward``
    (``layers/layernorm.py`` lines 21-26, 34-40) overwrite the caller's tensor: layer 0's
    residual (``models/qwen3.py`` line 152 keeps ``hidden_states`` as the residual after
    normalising it) and every returned residual (an alias of the normalised output) become
    normalised, a different model from transformers'. The wrapper hands ``rms_forward`` a
    copy, and forms the residual sum itself (``x + residual``, the same float32 addition)."""
    rmsnorm = layernorm.RMSNorm
    original = rmsnorm.forward
    if getattr(original, "_h2d_fp32_wrapper", False):
        return

    @functools.wraps(original)
    def forward(self: Any, x: Any, residual: Any = None) -> Any:
        import torch

        if x.dtype != torch.float32:
            return original(self, x, residual)
        if residual is None:
            return self.rms_forward(x.clone())
        total = x + residual
        return self.rms_forward(total.clone()), total

    forward._h2d_fp32_wrapper = True  # type: ignore[attr-defined]
    rmsnorm.forward = forward


def _drop_pin_memory(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapper


def _cuda_to_cpu(device: Any) -> Any:
    return "cpu" if str(device).startswith("cuda") else device


def patch_for_cpu(kv_blocks: int, block_bytes: int) -> None:
    """Process-wide patches so nano-vllm's ``ModelRunner`` (``engine/model_runner.py``)
    runs on a CPU-only torch, with ``enforce_eager=True`` (no CUDA graphs). The KV cache
    ``allocate_kv_cache`` sizes from "free GPU memory" is ``kv_blocks`` blocks of
    ``block_bytes`` (:func:`kv_block_bytes`): size it so the scheduler never preempts (the
    fork's preemption path crashes). Call before importing nano-vllm."""
    # its Triton kernel store_kvcache (layers/attention.py:10-40) runs in Triton's interpreter
    # on CPU tensors; read when @triton.jit decorates (triton/runtime/jit.py:917), so before
    # nano-vllm's import
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.distributed as dist

    # RMSNorm, SiluAndMul, RotaryEmbedding and Sampler are @torch.compile'd
    # (layers/layernorm.py:16,28, activation.py:11, rotary_embedding.py:37, sampler.py:88):
    # run them eagerly (inductor on CPU would compile C++ for minutes); dynamo reads the flag
    # whenever a compiled function runs
    torch._dynamo.config.disable = True
    # model_runner.py:124-147,237,270-274: pin_memory=True needs an accelerator; drop it
    torch.zeros = _drop_pin_memory(torch.zeros)
    torch.empty = _drop_pin_memory(torch.empty)
    torch.tensor = _drop_pin_memory(torch.tensor)
    # model_runner.py:237,270-274,290-293,325-329: tensor.cuda(non_blocking=True) uploads;
    # on CPU a copy, as an upload is (never an alias of the reused host buffer)
    torch.Tensor.cuda = lambda self, *a, **k: self.clone()  # type: ignore[method-assign]
    # model_runner.py:90: set_default_device("cuda") while the model and caches are built
    set_default_device = torch.set_default_device
    torch.set_default_device = lambda device: set_default_device(_cuda_to_cpu(device))
    # model_runner.py:62,157,191-192,197: torch.cuda calls with no CPU meaning: no-ops
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda *a, **k: None
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    # model_runner.py:202-218: the KV cache's size from (free, total) and the allocator's
    # current bytes: free * 0.9 = kv_blocks and a half blocks (its int(...) // block_bytes
    # then gives kv_blocks whatever the float rounding), nothing allocated, total = free
    free = (kv_blocks + 0.5) * block_bytes / 0.9
    torch.cuda.mem_get_info = lambda *a, **k: (int(free), int(free))
    torch.cuda.memory_stats = lambda *a, **k: {"allocated_bytes.all.current": 0}
    # model_runner.py:60-61: NCCL on Linux, over a TCP store on a probed port: gloo over an
    # in-process store (world size 1: no port, so parallel test workers never collide)
    init_process_group = dist.init_process_group

    def gloo_init(backend: str | None = None, init_method: str | None = None,
                  world_size: int = -1, rank: int = -1, **kwargs: Any) -> Any:
        if world_size != 1:
            raise NotImplementedError("the CPU harness runs nano-vllm with one rank")
        return init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)

    dist.init_process_group = gloo_init  # type: ignore[assignment]


def kv_block_bytes(hf_config: Any, block_size: int = 256) -> int:
    """One KV block's bytes as ``allocate_kv_cache`` (model_runner.py:204-206) counts it, in
    the config's dtype (the runner's, model_runner.py:65-88)."""
    import torch

    dtype = getattr(hf_config, "dtype", None) or torch.bfloat16
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads)
    return (2 * hf_config.num_hidden_layers * block_size * hf_config.num_key_value_heads
            * head_dim * dtype.itemsize)
