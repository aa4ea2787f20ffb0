"""The rule by which `launching.run_launched` runs a multi-process launch a second time: only when workers died by a
signal, one by SIGABRT or SIGSEGV, and none failed in Python (torchrun's failure report)."""

import pytest
from launching import _crashed


def _report(*codes: int) -> str:
    return "\n".join(
        f"  [{rank}]:\n    rank      : {rank}\n    exitcode  : {code} (pid: {100 + rank})"
        for rank, code in enumerate(codes)
    )


@pytest.mark.parametrize(
    "codes, crashed",
    [
        ((-15, -6), True),  # the CI failure: rank 1 aborted, rank 0 stopped by the launcher
        ((-11,), True),
        ((1, -15), False),  # a Python error in a worker: never run again
        ((-15, -15), False),  # stopped from outside (a timeout, a user)
        ((-9, -15), False),  # killed, e.g. out of memory
        ((), False),  # no torchrun report: a single process
    ],
)
def test_only_a_crash_by_signal_is_run_again(codes, crashed):
    assert _crashed(_report(*codes)) is crashed
