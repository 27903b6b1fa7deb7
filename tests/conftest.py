import pytest

from helpers import layouts, prepare_bytes

# The test modules whose `runs` fixture is a suite of tests/layouts_worker.py
LAYOUT_SUITES = {"test_parity": "dp", "test_tp": "tp", "test_pipeline": "pipeline", "test_context": "cp",
                 "test_moe": "ep", "test_composition": "matrix"}


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory):
    """The byte-level Shakespeare corpus, prepared once per test session."""
    return prepare_bytes(tmp_path_factory.mktemp("data") / "shakespeare")


@pytest.fixture(scope="session")
def layout_suites(request, tmp_path_factory):
    """Every layouts_worker suite this session's tests ask for (through their module's `runs`), in
    one 8-rank launch: the group's startup, ~9 s of the 2-core machine, is paid once, not once a
    module. suite -> results."""
    wanted = [suite for module, suite in LAYOUT_SUITES.items()
              if any(item.module.__name__ == module and "runs" in item.fixturenames for item in request.session.items)]
    return layouts(tmp_path_factory.mktemp("layouts"), wanted)
