import os

import pytest
import torch

from tests.factories import ENGINE_MODES, start_server

if not torch.cuda.is_available():
    # the Triton kernels run in Triton's interpreter; it is chosen when they are defined,
    # so before any test imports them
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kernel-matrix",
        choices=("full", "native"),
        default="full",
        help="full (make test, CI): the kernel tests at every ISA level up to this CPU's and "
        "every shape; native (make test-fast): this CPU's own level, each kernel test once",
    )


def _params(item: pytest.Item) -> dict[str, object]:
    callspec = getattr(item, "callspec", None)
    return callspec.params if callspec is not None else {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The marks the matrix is cut by, given here once: `kernels` for every test that
    runs the C kernels at a forced ISA level (the `isa` fixture), `interpreter` for every
    test that runs the Triton kernels on the CPU (its own mark, or a "triton" parameter).
    With --kernel-matrix native, of those only the first parameter set of each test at
    this CPU's own level runs."""
    cuda = torch.cuda.is_available()
    for item in items:
        if "isa" in item.fixturenames:
            item.add_marker(pytest.mark.kernels)
        if not cuda and "triton" in _params(item).values():
            item.add_marker(pytest.mark.interpreter)
        if not cuda and "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs CUDA; none on this machine"))
    if config.getoption("kernel_matrix") == "native":
        _native_only(config, items)


def _native_only(config: pytest.Config, items: list[pytest.Item]) -> None:
    from model.backends.cpu.isa import native_isa

    keep, drop, seen = [], [], set()
    for item in items:
        if "kernels" in item.keywords or "interpreter" in item.keywords:
            key = (item.path, item.originalname)
            if _params(item).get("isa", native_isa()) != native_isa() or key in seen:
                drop.append(item)
                continue
            seen.add(key)
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session", params=list(ENGINE_MODES))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """One live `kvserve serve` (demo model) shared by the API and deploy tests, in each
    engine mode: the engine in a thread of the server's process, and in its own process
    (--engine-process): every test that takes it runs against both."""
    mode = ENGINE_MODES[request.param]
    srv = start_server(
        str(tmp_path_factory.mktemp("srv")), "--max-num-seqs", "32", "--engine-process", mode
    )
    yield srv
    srv.stop()
