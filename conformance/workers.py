"""CPU threads of pytest-xdist workers (the conformance suite and the project's tests share it)."""

from __future__ import annotations

import os

import torch


def share_cores_between_workers() -> None:
    """Give torch's CPU kernels one share of the cores per xdist worker. Two workers each running two threads on two
    cores spend as long in the kernel scheduler as in the cases (measured on the 2-core CI machine: a conformance
    selection took 100 s with two threads per worker, 62 s with one). ``OMP_NUM_THREADS``, when set, wins; without
    xdist nothing changes."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
