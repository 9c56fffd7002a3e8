"""Shared fixtures; tests marked `gpu` are skipped where no CUDA GPU is visible (CI).

The tests need the extension built even without a GPU (the build and ptxas checks,
the C++ front's CPU fallback), so INSTANCE_NORM_BUILD=1 is set here, before any
test imports solution; subprocesses inherit it. tests/test_import.py unsets it
where it tests the import without a build."""
import importlib.util
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["INSTANCE_NORM_BUILD"] = "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def solution():
    """The solution module, imported once (this builds the extension)."""
    import solution as module
    return module


@pytest.fixture(scope="session")
def nets(solution):
    """benchmarks/nets.py as a module (the real-network benchmark's nets)."""
    spec = importlib.util.spec_from_file_location("nets", os.path.join(ROOT, "benchmarks", "nets.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
