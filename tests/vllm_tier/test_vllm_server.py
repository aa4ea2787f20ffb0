"""`vllm_mode="server"` as far as a CPU allows: vLLM's own server started by the test as TRL 1.16 recommends in place
of the deprecated `trl vllm-serve` (`VLLM_SERVER_DEV_MODE=1 vllm serve ...` with the settings of TRL's `build_command`;
a subprocess on a free port, stopped by its PID), generation through TRL's `VLLMClient`, and training against it,
which TRL 1.16 refuses without CUDA (its weight sync runs on vLLM's NCCL engine): the refusal is TRL's own
NotImplementedError and nothing of ours fails first. With no server answering, the trainer fails within TRL's
`vllm_server_timeout`, not later."""

import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
from launching import free_port
from shared import contains_answer_reward, cpu_config
from vllm_runs import COLOCATE, save_vllm_model


pytestmark = pytest.mark.vllm

SERVER_START_S = 600  # 3 processes each importing vLLM: ~1.5 min on 2 busy cores


def server_trainer(model, dataset, output_dir, base_url: str, timeout_s: float):
    from cegppo_trl import CEGPPOConfig, CEGPPOTrainer

    options = {**COLOCATE, "vllm_mode": "server", "vllm_server_base_url": base_url, "vllm_server_timeout": timeout_s}
    args = cpu_config(CEGPPOConfig, output_dir, **options)
    return CEGPPOTrainer(model=str(model), reward_funcs=contains_answer_reward, args=args, train_dataset=dataset)


@pytest.fixture(scope="module")
def vllm_server(tiny_tokenizer, tmp_path_factory):
    """`vllm serve` on the tiny model, as `trl vllm-serve` tells to run it; yields (its base URL, the model's folder).
    Stopped by PID (SIGTERM, then SIGKILL to its process group if it has not exited after 60 s)."""
    import requests

    model = save_vllm_model(tiny_tokenizer, tmp_path_factory.mktemp("server-model") / "tiny")
    port = free_port()
    log = tmp_path_factory.mktemp("server-log") / "vllm-serve.log"
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    # TRL 1.16's own command line (its deprecation warning prints it as `vllm` + this), run by vLLM's CLI.
    options = ScriptArguments(model=str(model), host="127.0.0.1", port=port, dtype="float32", max_model_len=256)
    command = build_command(options)
    argv = [str(Path(sys.executable).parent / "vllm"), *command[command.index("serve") :]]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    with open(log, "w") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            assert server.poll() is None, f"vllm serve exited ({server.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no /health after {SERVER_START_S} s:\n{log.read_text()[-4000:]}"
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(2)
        yield url, model
    finally:
        os.kill(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def test_generation_through_trls_client(vllm_server, tiny_tokenizer):
    from trl.generation.vllm_client import VLLMClient

    url, _ = vllm_server
    client = VLLMClient(base_url=url, connection_timeout=30)
    prompts = [tiny_tokenizer("What is 2+3?")["input_ids"], tiny_tokenizer("What is 4+4?")["input_ids"]]
    out = client.generate(prompts, n=2, max_tokens=8, temperature=1.0)
    assert out["prompt_ids"] == prompts
    assert len(out["completion_ids"]) == 4 and all(1 <= len(ids) <= 8 for ids in out["completion_ids"])
    assert [len(lp) for lp in out["logprobs"]] == [len(ids) for ids in out["completion_ids"]]


def test_training_in_server_mode_is_refused_by_trl_only(vllm_server, arithmetic_dataset, tmp_path):
    url, model = vllm_server
    with pytest.raises(NotImplementedError, match="needs a CUDA device") as refused:
        server_trainer(model, arithmetic_dataset, tmp_path / "run", url, timeout_s=30)
    raised_in = traceback.extract_tb(refused.tb)[-1].filename
    assert raised_in.endswith(os.path.join("trl", "generation", "vllm_client.py")), raised_in


def test_no_server_answering_fails_within_trls_timeout(tiny_tokenizer, arithmetic_dataset, tmp_path):
    import requests

    model = save_vllm_model(tiny_tokenizer, tmp_path / "tiny")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    # TRL's own error (requests' ConnectionError, one line naming the URL and the timeout); nothing of ours before it.
    with pytest.raises(requests.ConnectionError, match=re.escape(f"can't be reached at {url} after 4 seconds")):
        server_trainer(model, arithmetic_dataset, tmp_path / "run", url, timeout_s=4)
    assert time.monotonic() - start < 4 + 60  # the timeout, plus loading the tiny model on a busy machine
