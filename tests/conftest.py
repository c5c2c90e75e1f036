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
