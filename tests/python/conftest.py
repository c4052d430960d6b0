"""pytest setup for qkv's Python suite: run by ctest (python_pytest) with PYTHONPATH=<build>/python.

torch is required, not optional: every parity test compares with it, and a suite that silently
skipped them would prove nothing (Debian: python3-torch).
"""
import numpy as np
import pytest
import torch

torch.set_num_threads(1)  # the shapes here are tiny; threads would only add noise on a busy machine


@pytest.fixture
def rng():
    """Fresh random data every run, as the C++ suite does; the seed is printed on failure."""
    seed = int(np.random.SeedSequence().entropy % (2**32))
    print(f"numpy seed {seed}")
    return np.random.default_rng(seed)
