"""Shared fixtures: a tiny model and tokenizer built locally (nothing from the Hub), CPU trainer configs, and the
end-to-end runs that several slow tests read (the wheel, one quick demo, one tiny-recipe run), each made once per
session."""

import copy
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from shared import (  # noqa: F401  (re-exported: `from conftest import ...` keeps working)
    DEMO_OUTPUT,
    HUB_EVAL_SETS,
    HUB_MODELS,
    HUB_TRAIN_SETS,
    PLACEHOLDER_MODELS,
    QUICK_DEMO_ARGS,
    ROOT,
    TINY_INSTRUCTION,
    TINY_RECIPE,
    contains_answer_reward,
    cpu_config,
    run_checked,
    wheel_env,
)


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread for the session, and (through the environment) for the processes tests start, unless
# OMP_NUM_THREADS says otherwise: the models here are tiny, and on a 2-core machine that also runs other work two
# intra-op threads spin waiting for each other (measured: 35 s instead of 11 s for the same three tests). Results do
# not depend on it (1 or 2 threads give bit-identical runs).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated.*")


@pytest.fixture
def one_torch_thread():
    """One torch thread for in-process runs of the tiny model, as the tests' subprocesses get (see above; idle, two
    are about 1.5x faster: docs/entropy_results.md, section 4)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from cegppo_trl.tiny_model import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def _tiny_base_model(tiny_tokenizer):
    from cegppo_trl.tiny_model import build_tiny_model

    # Smaller than the demo's model: the tests exercise logic, not learning.
    return build_tiny_model(tiny_tokenizer, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=0)


@pytest.fixture
def tiny_model(_tiny_base_model):
    """A fresh copy of the same randomly initialised weights for every test."""
    return copy.deepcopy(_tiny_base_model)


@pytest.fixture(scope="session")
def arithmetic_dataset():
    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {a}+{b}? Put the final answer in \\boxed{{}}."}],
            "solution": str(a + b),
        }
        for a in range(10)
        for b in range(10)
    ]
    return Dataset.from_list(rows)


@pytest.fixture
def tiny_trainer(tiny_model, tiny_tokenizer, arithmetic_dataset, tmp_path):
    """`tiny_trainer(**config_overrides)`: `trl_batches.build` (a `CEGPPOTrainer` on `cpu_config`, the cheap reward) on
    this test's tiny model and tokenizer, the arithmetic set and tmp_path; `model=`, `output_dir=`, `cls=` (TRL's
    `GRPOTrainer` for parity) and `reward_funcs=` replace those."""
    from trl_batches import build

    def make(model=None, output_dir=None, **overrides):
        model, output_dir = tiny_model if model is None else model, tmp_path if output_dir is None else output_dir
        return build(model, tiny_tokenizer, arithmetic_dataset, output_dir, **overrides)

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(_tiny_base_model, tiny_tokenizer, tmp_path_factory) -> Path:
    """The tests' tiny model + tokenizer saved to a folder: the stand-in for every Hub model id in the docs."""
    from cegppo_trl.tiny_model import save_tiny

    path = tmp_path_factory.mktemp("doc-model") / "tiny"
    save_tiny(_tiny_base_model, tiny_tokenizer, path)
    return path


@pytest.fixture
def no_model_loading(monkeypatch):
    """Any model load fails the test: every check must come before it."""
    from cegppo_trl.evaluation import generation

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded although a check should have stopped the command")

    monkeypatch.setattr(generation, "load_model", no_loading)


# kernels 0.19's message (kernels/_internals/_versions.py) for a kernel neither cached nor downloadable
KERNELS_OFFLINE = (
    "Version 2 of 'kernels-community/rotary' is not available in the local cache and Hugging Face Hub is in offline "
    "mode. Download the kernel while online first, or pass an explicit `revision=<commit>`."
)


@pytest.fixture
def offline_kernel_loader(monkeypatch) -> list:
    """transformers' Hub kernel loader (`PreTrainedModel.set_use_kernels`, which `from_pretrained` calls with the
    resolved `use_kernels`; 5.25: on unless told not to, also on CPU, where no kernel is fetched) as on an offline GPU
    machine without the kernel cached: kernels on raise what `kernels` raises. Returns the calls that asked."""
    from transformers import PreTrainedModel

    calls, original = [], PreTrainedModel.set_use_kernels

    def set_use_kernels(self, use_kernels, *args, **kwargs):
        if use_kernels:
            calls.append(use_kernels)
            raise ValueError(KERNELS_OFFLINE)
        return original(self, use_kernels, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "set_use_kernels", set_use_kernels)
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    return calls


@pytest.fixture
def model_dir(tiny_checkpoint, tmp_path) -> Path:
    """A private copy of the tests' tiny checkpoint (tests write settings into it)."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "model"))


@pytest.fixture
def adapter_dir(tiny_checkpoint, tmp_path) -> Path:
    """A LoRA adapter folder as `cegppo-train --use_peft true` saves it (adapter + tokenizer, no config.json), with
    non-zero LoRA weights, on the tiny checkpoint; it declares the tiny prompt format."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cegppo_trl.evaluation import save_eval_settings

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora)
    path = tmp_path / "adapter"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_checkpoint).save_pretrained(path)
    save_eval_settings(path, instruction=TINY_INSTRUCTION, temperature=1.0, max_new_tokens=6)
    assert (path / "adapter_config.json").is_file() and not (path / "config.json").exists()
    return path


@pytest.fixture(scope="session")
def stand_ins(tiny_checkpoint) -> dict[str, str]:
    values = {name: str(tiny_checkpoint) for name in (*HUB_MODELS, *PLACEHOLDER_MODELS)}
    values.update(dict.fromkeys(HUB_TRAIN_SETS, "builtin:arithmetic"))
    values.update(dict.fromkeys(HUB_EVAL_SETS, "builtin:arithmetic_eval"))
    return values


# End-to-end runs shared by the slow tests, each made once per session on first use, through the installed wheel's
# console scripts from a directory outside the checkout.


@pytest.fixture(scope="session")
def wheel_dist(tmp_path_factory) -> Path:
    """The sdist and wheel, built from a clean copy of the source (setuptools' build/ folder would otherwise carry
    modules deleted since a last build), with this environment's setuptools (`--no-isolation`: no download)."""
    out = tmp_path_factory.mktemp("dist")
    src = tmp_path_factory.mktemp("src") / "cegppo-trl"
    junk = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(ROOT, src, ignore=junk)
    run_checked([sys.executable, "-m", "build", "--sdist", "--wheel", "--no-isolation", "--outdir", out, src], src)
    return out


@pytest.fixture(scope="session")
def wheel_venv(wheel_dist, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed (`--no-deps --no-index`); its third-party packages come
    from the environment running the tests through a `.pth` line, so nothing is downloaded, and the checkout's own
    editable install is not visible there (`.pth` files of that environment are not processed)."""
    env_dir = tmp_path_factory.mktemp("wheel-venv") / "venv"
    run_checked([sys.executable, "-m", "venv", env_dir], cwd=env_dir.parent)
    python = env_dir / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(run_checked([python, "-c", purelib], env_dir).stdout.strip())
    (site / "_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheel = next(wheel_dist.glob("*.whl"))
    run_checked([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], env_dir)
    return env_dir


@dataclass
class ConsoleRun:
    cwd: Path  # where it ran: the demo's printed eval commands are relative to it; no recipes/ folder for the recipe
    out: Path  # cwd / DEMO_OUTPUT, or the recipe's --output_dir (builtin:tiny built in out / "tiny-init")
    proc: subprocess.CompletedProcess
    summary: dict | None = None  # the demo's results.json


@pytest.fixture(scope="session")
def quick_demo(wheel_venv, tmp_path_factory) -> ConsoleRun:
    """`cegppo-demo` + `QUICK_DEMO_ARGS`, with the default output directory."""
    cwd = tmp_path_factory.mktemp("quick-demo")
    proc = run_checked(["cegppo-demo", *QUICK_DEMO_ARGS], cwd, wheel_env(wheel_venv))
    out = cwd / DEMO_OUTPUT
    return ConsoleRun(cwd, out, proc, json.loads((out / "results.json").read_text()))


@pytest.fixture(scope="session")
def tiny_recipe_run(wheel_venv, tmp_path_factory) -> ConsoleRun:
    """`cegppo-train --config recipes/tiny/cegppo/config_cpu.yaml` from a directory with no recipes/ folder (so the
    wheel's shipped recipe is used)."""
    cwd = tmp_path_factory.mktemp("tiny-recipe")
    assert not (cwd / "recipes").exists()
    proc = run_checked(["cegppo-train", "--config", TINY_RECIPE, "--output_dir", "run"], cwd, wheel_env(wheel_venv))
    return ConsoleRun(cwd, cwd / "run", proc)


@pytest.fixture(scope="session")
def tiny_recipe_model_dir(tiny_recipe_run) -> Path:
    """The tiny model exactly as `builtin:tiny` builds it for the tiny recipe (its seed and SFT steps): the shared
    recipe run built it in `<output_dir>/tiny-init`. Read only."""
    path = tiny_recipe_run.out / "tiny-init"
    assert (path / "config.json").is_file() and (path / "tiny_build.json").is_file()
    return path


# The real-model tier's fixtures (tests/real_model/; a conftest.py there would replace this module in sys.modules):
# SmolLM2-135M-Instruct built from the package index (build_smollm2.py, cached in build/real-model), and the
# `cegppo-train` runs that several of its tests read (real_runs.train), each made once per session. Their modules
# are imported when a real-model test asks, from the folder pytest put on sys.path to collect it.
@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The built model directory (built here if missing or not matching its recorded hashes)."""
    from build_smollm2 import BuildError, build

    try:
        return build()
    except BuildError as error:
        pytest.fail(f"build_smollm2: {error}", pytrace=False)


@pytest.fixture(scope="session")
def full_run(smollm2_dir, tmp_path_factory):
    """Full-parameter training on one process (the console command)."""
    from real_runs import train

    return train(smollm2_dir, tmp_path_factory.mktemp("real-model") / "full-1", processes=1, lora=False)


@pytest.fixture(scope="session")
def lora_run(smollm2_dir, tmp_path_factory):
    """LoRA training on two gloo processes."""
    from real_runs import train

    return train(smollm2_dir, tmp_path_factory.mktemp("real-model") / "lora-2", processes=2, lora=True)
