"""The commands compose: `cegppo-demo` saves the models it trains with their prompt format and sampling settings, and
`cegppo-eval` on a saved model, run as the demo prints it, reproduces the demo's own held-out figure."""

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch

from cegppo_trl import evaluation
from cegppo_trl.demo import run as demo


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# The quick demo (its 150 SFT steps leave the warm start solving ~10% of the held-out sums, so the figures are not
# trivially 0 or 1) with 4 RL steps, 2 samples per problem as the full demo evaluates.
ARGS = ["--quick", "--steps", "4", "--eval-size", "48", "--eval-samples", "2", "--no-progress"]
SETTINGS = ["instruction", "system_prompt", "temperature", "top_p", "max_new_tokens"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "out"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = demo.run_demo([*ARGS, "--output-dir", str(out)])
    finally:
        torch.set_num_threads(threads)
    return out, summary


def _figures(summary):
    """The demo's held-out accuracy of each model it saved, keyed as `summary["eval_commands"]`."""
    runs = {os.path.basename(r["output_dir"]): r for r in summary["runs"]}
    return {"warm_start": summary["warm_start"]["accuracy"], **{n: r["end_accuracy"] for n, r in runs.items()}}


def test_demo_saves_every_model_with_its_prompt_format(demo_run):
    out, summary = demo_run
    for path in (out / "warm_start", out / "runs" / "cegppo" / "final", out / "runs" / "grpo" / "final"):
        assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file(), path
        prompt = json.loads((path / evaluation.PROMPT_FILE).read_text())
        assert prompt["instruction"] == demo.DEMO_INSTRUCTION and prompt["system_prompt"] is None
        generation = json.loads((path / "generation_config.json").read_text())
        assert generation["do_sample"] is True and generation["temperature"] == 1.0 and generation["top_p"] == 1.0
        assert generation["top_k"] == 0 and generation["max_new_tokens"] == 20
        assert evaluation.load_eval_settings(path) == {
            "instruction": demo.DEMO_INSTRUCTION,
            "system_prompt": None,
            "temperature": 1.0,
            "top_p": 1.0,
            "max_new_tokens": 20,
        }
    rows = [json.loads(line) for line in (out / demo.HELDOUT_FILE).read_text().splitlines()]
    assert rows == demo.load_rows("builtin:arithmetic_eval", 48)
    assert set(summary["eval_commands"]) == {"warm_start", "cegppo", "grpo"}
    figures = _figures(summary)
    assert 0 < figures["warm_start"] < 1, figures  # not trivially all wrong or all right


def test_cegppo_eval_reproduces_the_demo_figures(demo_run, tmp_path, capsys):
    """Each printed command, run through `cegppo-eval`'s main with no prompt or sampling flags, gives exactly the
    demo's figure: the same prompts, seed, batches, generation code and grader, in the same process and threads."""
    out, summary = demo_run
    capsys.readouterr()
    figures = _figures(summary)
    for name, command in summary["eval_commands"].items():
        words = shlex.split(command)
        assert words[0] == "cegppo-eval" and "--instruction" not in words and "--temperature" not in words
        report_path = tmp_path / f"{name}.json"
        assert evaluation.main([*words[1:], "--output", str(report_path), "--no-progress"]) == 0
        assert "declares its evaluation settings" in capsys.readouterr().err
        report = json.loads(report_path.read_text())
        assert report["settings"]["from_checkpoint"] == SETTINGS
        assert report["settings"]["instruction"] == demo.DEMO_INSTRUCTION and report["settings"]["temperature"] == 1.0
        (metrics,) = report["datasets"].values()
        assert metrics["num_problems"] == 48 and metrics["k"] == 2
        assert metrics["avg@2"] == figures[name], (name, metrics["avg@2"], figures[name])


def test_console_script_reproduces_the_demo_figure(demo_run, tmp_path):
    """A user's run: the console script in a fresh process, exactly as the demo printed it, with the demo's thread
    count (1 here). Same figure, to the sample: nothing but the model directory carries the settings."""
    out, summary = demo_run
    command = summary["eval_commands"]["cegppo"]
    script = os.path.join(os.path.dirname(sys.executable), "cegppo-eval")
    argv = [script, *shlex.split(command)[1:], "--output", str(tmp_path / "report.json"), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "declares its evaluation settings" in done.stderr
    (metrics,) = json.loads((tmp_path / "report.json").read_text())["datasets"].values()
    assert metrics["avg@2"] == _figures(summary)["cegppo"]
    for name, command in summary["eval_commands"].items():  # the printed paths are the saved models
        words = shlex.split(command)
        assert os.path.isfile(os.path.join(words[1], evaluation.PROMPT_FILE)), (name, words[1])
        assert words[3] == str(out / demo.HELDOUT_FILE)
