"""The project's tests: xdist workers share the cores (``conformance.workers``)."""

from conformance.workers import share_cores_between_workers


def pytest_configure(config):
    share_cores_between_workers()
