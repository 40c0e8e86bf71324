import os
from collections.abc import Iterator

import pytest
import torch

from tests.live_server import Server, start_server

if not torch.cuda.is_available():
    # the Triton kernels run in Triton's interpreter; it is chosen when they are defined,
    # so before any test imports them
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One live `kvserve serve` (demo model) shared by the API and deploy tests."""
    srv = start_server(str(tmp_path_factory.mktemp("srv")), "--max-num-seqs", "32")
    yield srv
    srv.stop()
