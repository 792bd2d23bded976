import importlib.util

import pytest


def pytest_collection_modifyitems(config, items):
    have_cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        have_cuda = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not have_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
