import pytest
import torch

from tests.export.models import QuantModels


@pytest.fixture(scope="session")
def qmodels(tmp_path_factory):
    return QuantModels(tmp_path_factory.mktemp("qmodels"))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from threads and lose a lot on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
