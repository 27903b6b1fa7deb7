import pytest

from helpers import prepare_bytes


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory):
    """The byte-level Shakespeare corpus, prepared once per test session."""
    return prepare_bytes(tmp_path_factory.mktemp("data") / "shakespeare")
