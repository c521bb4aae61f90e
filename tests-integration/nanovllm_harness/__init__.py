"""Stock nano-vllm (PyPI ``nano-vllm-fork==20260210``) under test on CPU, unedited: a
flash-attn stand-in (``flash_attn_standin``), the wrappers its quirks need (``compat``), a
random-weight Qwen3 model directory (``model_dir``) and the subprocess script that runs it
(``stock_cpu``); the library as nano-vllm's metadata path (``library_runner``: a
``ModelRunner`` subclass and the page-list lineage mapping) and the scripts that run it
checked against stock's uploads (``library_cpu``, ``library_cuda`` on a GPU). Named
``nanovllm_harness``, not ``nanovllm``: ``tests-integration`` is on pytest's path, and a
package named ``nanovllm`` there would shadow the real one.

Importing this package imports nothing else (the subprocess script starts here)."""
