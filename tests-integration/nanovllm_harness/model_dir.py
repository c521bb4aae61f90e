"""A small random-weight Qwen3 written as a model directory nano-vllm's ``LLM`` can load.

nano-vllm reads ``config.json`` through ``AutoConfig`` (``config.py`` line 24), the weights
from ``*.safetensors`` (``utils/loader.py`` lines 43-70) and, unless a ``tokenizer`` is
passed, ``AutoTokenizer.from_pretrained(model)`` (``engine/llm_engine.py`` lines 31-36; its
``eos_token_id`` is the scheduler's stop token and ``generate`` decodes every output). So
the directory holds transformers' own ``save_pretrained`` of a seeded
``Qwen3ForCausalLM`` in bf16 and a word-level tokenizer built offline (token ``i`` is the
word ``t{i}``), no download. The same directory is the oracle's: transformers'
``from_pretrained`` loads the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: GQA (4 query heads over 2 key/value heads), q/k norms, untied head; a 1024-position
#: table (nano-vllm's max_model_len is capped by it)
CONFIG: dict[str, Any] = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
    bos_token_id=None, eos_token_id=511, pad_token_id=0)


def write_tokenizer(path: Path, vocab_size: int, eos_id: int) -> None:
    """A ``PreTrainedTokenizerFast`` over a word-level vocabulary ``t0 .. t{n-1}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0",
                                  eos_token=f"t{eos_id}", pad_token="t0")
    tok.save_pretrained(path)


def write_model_dir(path: str | Path, seed: int = 0, dtype: str = "bfloat16",
                    config: dict[str, Any] | None = None) -> Path:
    """Write the model (safetensors in ``dtype``, config) and tokenizer to ``path``; return it.

    ``config``: ``Qwen3Config`` keywords laid over :data:`CONFIG` (a larger shape: the
    benchmark's Qwen3-0.6B); its ``vocab_size`` and ``eos_token_id`` shape the tokenizer.

    Weights are transformers' initialisation under ``torch.manual_seed(seed)``, every norm
    weight then drawn around 1 (the init's all-ones would hide a norm loaded into the
    wrong place) and the LM head widened (logits further apart than the init's)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    keywords = {**CONFIG, **(config or {})}
    cfg = Qwen3Config(**keywords)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
        model.lm_head.weight.mul_(8.0)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    write_tokenizer(path, cfg.vocab_size, keywords["eos_token_id"])
    return path
