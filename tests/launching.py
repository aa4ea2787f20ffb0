"""What the tests that start processes share: a free local port, the environment of a test subprocess, and the
metrics every training step of a launched run must log."""

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


# Logged at every optimizer step of a CE-GPPO run (CE-GPPO's own metrics and TRL's that it relies on).
STEP_METRICS = (
    "cegppo/beta1_token_frac",
    "cegppo/beta2_token_frac",
    "cegppo/beta1_grad_share",
    "cegppo/beta2_grad_share",
    "cegppo/beta1",
    "cegppo/beta2",
    "cegppo/quadrant/neg_low/token_frac",
    "cegppo/quadrant/pos_low/token_frac",
    "clip_ratio/region_mean",
    "entropy",
)
