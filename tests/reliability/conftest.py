import pytest

from tests.reliability.harness import LEDGER, run_args, train


@pytest.fixture(scope="session")
def baseline(shapes, tmp_path_factory):
    """The uninterrupted run every fault run is compared with."""
    run_dir = tmp_path_factory.mktemp("baseline") / "run"
    train(run_args(shapes, run_dir), run_dir.parent / "log.txt")
    return run_dir


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each test's ledger rows travel with its report, so that the session's ledger (tests/conftest.py) adds them
    up on the process that prints the summary, also when pytest-xdist ran the test in a worker."""
    outcome = yield
    if call.when == "call":
        outcome.get_result().user_properties.extend(("fault ledger", list(row)) for row in LEDGER)
        LEDGER.clear()
