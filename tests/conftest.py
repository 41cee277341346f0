"""Session hooks: the Triton interpreter suites start as soon as collection ends.

They run in subprocesses on one core each (``cases.run_under_interpreter``), for minutes; started early they overlap
the rest of the session, which leaves a core idle much of the time, instead of running at the end with one core idle.
"""

from cases import start_interpreter_suite, stop_interpreter_suites


def pytest_collection_finish(session) -> None:
    for item in session.items:
        if item.name == "test_interpreter_suite":
            start_interpreter_suite(item.path)


def pytest_sessionfinish(session, exitstatus) -> None:
    stop_interpreter_suites()
