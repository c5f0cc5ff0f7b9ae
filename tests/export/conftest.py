import pytest

from tests.export.models import QuantModels


@pytest.fixture(scope="session")
def qmodels(tmp_path_factory):
    return QuantModels(tmp_path_factory.mktemp("qmodels"))


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield
