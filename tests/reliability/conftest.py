import pytest

from tests.reliability.harness import LEDGER, run_args, train


@pytest.fixture(scope="session")
def baseline(shapes, tmp_path_factory):
    """The uninterrupted run every fault run is compared with."""
    run_dir = tmp_path_factory.mktemp("baseline") / "run"
    train(run_args(shapes, run_dir), run_dir.parent / "log.txt")
    return run_dir


def pytest_terminal_summary(terminalreporter) -> None:
    if not LEDGER:
        return
    terminalreporter.section("fault ledger (docs/reliability.md)")
    terminalreporter.write_line(f"{'guarantee':<42} {'faults':>7} {'survived':>9} {'samples lost':>13}")
    for row in sorted(LEDGER):
        terminalreporter.write_line(f"{row[0]:<42} {row[1]:>7} {row[2]:>9} {row[3]:>13}")
    totals = [sum(row[i] for row in LEDGER) for i in (1, 2, 3)]
    terminalreporter.write_line(f"{'total':<42} {totals[0]:>7} {totals[1]:>9} {totals[2]:>13}")
