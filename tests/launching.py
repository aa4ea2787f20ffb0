"""What the tests that start processes share: a free local port and the environment of a test subprocess."""

import os
import socket


def free_port() -> int:
    """A free TCP port on the loopback interface, for `--main_process_port` / `--master_port`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict[str, str]:
    """This environment, offline (nothing from the Hub), one torch thread per process (2 processes on 2 cores),
    unbuffered output."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return env
