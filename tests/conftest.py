"""Session hooks: the Triton interpreter suites start as soon as collection ends.

They run in subprocesses on one core each (``cases.run_under_interpreter``), for minutes; started early they overlap
the rest of the session, which leaves a core idle much of the time, instead of running at the end with one core idle.

Every test starts from the same global torch random state: a test that draws from it (unseeded stochastic rounding,
``torch.randn``) sees the same numbers whatever ran before it (a test that passed or failed by the suite's order).
"""

import pytest
import torch

from cases import start_interpreter_suite, stop_interpreter_suites


@pytest.fixture(autouse=True)
def same_global_random_state():
    torch.manual_seed(0)


def pytest_collection_finish(session) -> None:
    for item in session.items:
        if item.name == "test_interpreter_suite":
            start_interpreter_suite(item.path)


def pytest_sessionfinish(session, exitstatus) -> None:
    stop_interpreter_suites()
