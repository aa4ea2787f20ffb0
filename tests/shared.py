"""What several test modules share that is not a fixture (`conftest.py` imports it for its fixtures): the cheap reward,
the small CPU config, a hand-built loss batch, the Hub names the docs use, and running a command or the wheel's
environment."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch


def contains_answer_reward(completions, solution, **kwargs):
    """+1 if the completion contains the answer's last digit or its character-code sum is even, else -1: a cheap
    reward that a random tiny model earns about half the time, so groups have non-zero advantages."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if s[-1] in t or sum(map(ord, t)) % 2 == 0 else -1.0 for t, s in zip(texts, solution)]


def cpu_config(cls, output_dir, **overrides):
    """A small CPU config: 8 prompts x 4 completions per step, short completions, off-policy by default."""
    values = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        gradient_accumulation_steps=1,
        steps_per_generation=4,
        max_steps=4,
        learning_rate=5e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        temperature=1.0,
    )
    values.update(overrides)
    return cls(**values)


def make_loss_batch(tokenizer, batch_size=6, prompt_len=5, completion_len=7, seed=0, dtype=torch.float32):
    """A hand-built training batch with ragged completions and random advantages (old log-probs added later)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    prompt_ids = torch.randint(3, vocab, (batch_size, prompt_len), generator=gen)
    completion_ids = torch.randint(3, vocab, (batch_size, completion_len), generator=gen)
    lengths = torch.randint(1, completion_len + 1, (batch_size,), generator=gen)
    lengths[0] = completion_len
    completion_mask = (torch.arange(completion_len).unsqueeze(0) < lengths.unsqueeze(1)).long()
    advantages = torch.randn(batch_size, generator=gen, dtype=dtype)
    advantages[-1] = 0.0  # a zero-advantage completion
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
    }


# The docs name Hub ids; tests run them on local stand-ins (tests/test_docs.py, tests/test_wheel.py).
HUB_MODELS = ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B")
HUB_TRAIN_SETS = ("Kwai-Klear/KlearReasoner-MathSub-30K",)
HUB_EVAL_SETS = ("HuggingFaceH4/MATH-500", "math-ai/aime24", "math-ai/aime25", "math-ai/amc23")
PLACEHOLDER_MODELS = ("MODEL", "CHECKPOINT")  # placeholders the docs use in commands


ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # this environment's console scripts
RUN_TIMEOUT_S = 900  # generous: the machine may be shared; a normal run takes well under a minute
TINY_RECIPE = "recipes/tiny/cegppo/config_cpu.yaml"
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))
# The quick demo as the docs' `cegppo-demo` runs in the tests: `--quick` with 4 RL steps, and 2 samples per held-out
# problem as the full demo (so the README's `cegppo-eval ... --k 2` command applies to it as written).
QUICK_DEMO_ARGS = ("--quick", "--steps", "4", "--eval-samples", "2", "--no-progress")
DEMO_OUTPUT = "cegppo-demo-output"  # `cegppo-demo`'s default --output-dir, as the docs name it
# The tiny model is SFT-trained on this user message format (the tiny recipe's and the demo's instruction).
TINY_INSTRUCTION = "{problem} Put the final answer in \\boxed{}."


def recipe_id(path: Path) -> str:
    """A recipe's path under recipes/, the id of the tests run per recipe."""
    return path.relative_to(ROOT / "recipes").as_posix()


def write_problems(path: Path, answers) -> Path:
    """Rows "What is a+1?" with the given answers (the stand-in vLLM always answers 2)."""
    rows = [{"problem": f"What is {int(a) - 1}+1?", "answer": str(a)} for a in answers]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_checked(argv, cwd, env=None, timeout=RUN_TIMEOUT_S, expect=0) -> subprocess.CompletedProcess:
    """Run a command; fail the test with the command's output tails if it does not exit `expect`."""
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == expect, (
        f"`{' '.join(map(str, argv))}` failed ({proc.returncode})\n--- stdout ---\n{proc.stdout[-3000:]}\n"
        f"--- stderr ---\n{proc.stderr[-6000:]}"
    )
    return proc


def wheel_env(venv: Path) -> dict:
    """The environment of a user of the installed wheel: its `bin/` first on PATH, offline, one torch thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        PATH=f"{venv / 'bin'}:{env.get('PATH', '')}",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


EVAL_SETTING_NAMES = ["instruction", "system_prompt", "temperature", "top_p", "top_k", "max_new_tokens"]


def train_error(err: str) -> str:
    """The one line `cegppo-train` printed: the last one, the only one of ours, no traceback."""
    ours = [line for line in err.strip().splitlines() if line.startswith("cegppo-train: ")]
    assert len(ours) == 1 and err.strip().splitlines()[-1] == ours[0] and "Traceback" not in err, err[-3000:]
    return ours[0]


def eval_error(argv, capsys) -> str:
    """`cegppo-eval`'s `main` on `argv` exits with status 2; what it wrote to stderr."""
    import pytest

    from cegppo_trl.scripts.eval import main

    with pytest.raises(SystemExit) as error:
        main([str(a) for a in argv])
    assert error.value.code == 2
    return capsys.readouterr().err


def in_threads(fn, n=1, timeout=120) -> list:
    """What `fn()` returns (or raises) in each of `n` threads run at once."""
    import threading

    out = {}

    def call(i):
        try:
            out[i] = fn()
        except BaseException as error:  # noqa: BLE001 - returned to the test
            out[i] = error

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(thread.is_alive() for thread in threads)
    return [out[i] for i in range(n)]


def assert_saved_settings(path: Path, instruction: str, temperature: float, max_new_tokens: int) -> None:
    """A model saved by `cegppo-train` or `cegppo-demo` carries its prompt format and sampling settings."""
    from cegppo_trl.prompt_settings import PROMPT_FILE, load_eval_settings

    prompt = json.loads((path / PROMPT_FILE).read_text())
    assert prompt["instruction"] == instruction and prompt["system_prompt"] is None
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["do_sample"] is True and generation["temperature"] == temperature and generation["top_k"] == 0
    assert generation["top_p"] == 1.0 and generation["max_new_tokens"] == max_new_tokens
    sampling = {"temperature": temperature, "top_p": 1.0, "top_k": 0, "max_new_tokens": max_new_tokens}
    assert load_eval_settings(path) == {"instruction": instruction, "system_prompt": "", **sampling}


def load_script(path: Path):
    """A Python file outside the package (.ci/, experiments/) imported as a module, under its file's name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_train_args(*argv: str):
    """`cegppo-train`'s parse of `argv` + `--use_cpu true` (no GPU here: a recipe's `bf16: true` then parses), failing
    on a deprecated option (ours, TRL's or transformers' warn with a FutureWarning or DeprecationWarning)."""
    import warnings

    from cegppo_trl.scripts.train import make_parser

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        return make_parser().parse_args_and_config(args=[*map(str, argv), "--use_cpu", "true"])


def assert_trained_lora_adapter(output_dir: Path, base_dir: Path):
    """`output_dir` holds a LoRA adapter (no full model) that loads on the model in `base_dir` and trained: its B
    matrices (zero at the start) are not all zero."""
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert (output_dir / "adapter_config.json").is_file() and not (output_dir / "model.safetensors").exists()
    with warnings.catch_warnings():  # peft asks transformers' deprecated `is_gradient_checkpointing`
        warnings.simplefilter("ignore", FutureWarning)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), output_dir)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b), "LoRA B matrices are still zero: nothing trained"


def assert_trls_vllm_serve_settings(argv: list[str]):
    """A `vllm serve` command line carries every setting TRL 1.16's `trl vllm-serve` imposes (its `build_command`),
    with its value, and `--enable-scale-out` (added only with vllm >= 0.30.0, which the `vllm` extra pins)."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    trl = build_command(ScriptArguments(model="m"))
    imposed = trl[trl.index("--weight-transfer-config") :]
    for flag, value in zip(imposed[::2], imposed[1::2]):
        assert flag in argv and argv[argv.index(flag) + 1] == value, (flag, value, argv)
    assert "--enable-scale-out" in argv
