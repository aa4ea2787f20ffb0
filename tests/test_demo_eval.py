"""The commands compose: `cegppo-demo` saves the models it trains with their prompt format and sampling settings, and
`cegppo-eval` on a saved model, run as the demo prints it, reproduces the demo's own held-out figure.

The demo is the shared quick run of conftest.py (`quick_demo`: the quick demo, whose 150 SFT steps leave the warm
start solving ~10% of the held-out sums, so the figures are not trivially 0 or 1, with 4 RL steps and 2 samples per
problem as the full demo evaluates), made by the installed wheel's `cegppo-demo` in a subprocess with one thread."""

import json
import os
import shlex

import pytest
from shared import BIN, EVAL_SETTING_NAMES, assert_saved_settings, run_checked

from cegppo_trl import prompt_settings
from cegppo_trl.demo import lm as demo


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture
def demo_run(quick_demo, monkeypatch):
    """The shared quick demo; the commands it printed name paths relative to the directory it ran in."""
    monkeypatch.chdir(quick_demo.cwd)
    return quick_demo.out, quick_demo.summary


def _figures(summary):
    """The demo's held-out accuracy of each model it saved, keyed as `summary["eval_commands"]`."""
    runs = {os.path.basename(r["output_dir"]): r for r in summary["runs"]}
    return {"warm_start": summary["warm_start"]["accuracy"], **{n: r["end_accuracy"] for n, r in runs.items()}}


def test_demo_saves_every_model_with_its_prompt_format(demo_run):
    out, summary = demo_run
    for path in (out / "warm_start", out / "runs" / "cegppo" / "final", out / "runs" / "grpo" / "final"):
        assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file(), path
        assert_saved_settings(path, demo.DEMO_INSTRUCTION, temperature=1.0, max_new_tokens=20)
    rows = [json.loads(line) for line in (out / demo.HELDOUT_FILE).read_text().splitlines()]
    assert rows == demo.load_rows("builtin:arithmetic_eval", summary["sizes"]["eval_size"])
    figures = _figures(summary)
    assert 0 < figures["warm_start"] < 1, figures  # not trivially all wrong or all right


def test_cegppo_eval_reproduces_the_demo_figures(demo_run, tmp_path, capsys):
    """Each printed command, run with no prompt or sampling flags, gives exactly the demo's figure: the same prompts,
    seed, batches, generation code and grader; nothing but the model directory carries the settings. The CE-GPPO
    model's command runs as a user runs it, the console script in a fresh process with the demo's thread count (1);
    the warm start's and GRPO's run through the same `main` in this process (one thread)."""
    from cegppo_trl.scripts.eval import main as eval_main

    out, summary = demo_run
    sizes = summary["sizes"]
    figures = _figures(summary)
    assert set(summary["eval_commands"]) == set(figures) == {"warm_start", "cegppo", "grpo"}
    capsys.readouterr()
    for name, command in summary["eval_commands"].items():
        words = shlex.split(command)
        assert words[0] == "cegppo-eval" and "--instruction" not in words and "--temperature" not in words
        # The printed paths are the saved models and the held-out file.
        assert os.path.isfile(os.path.join(words[1], prompt_settings.PROMPT_FILE)), (name, words[1])
        assert os.path.samefile(words[3], out / demo.HELDOUT_FILE), (name, words[3])
        report_path = tmp_path / f"{name}.json"
        argv = [*words[1:], "--output", str(report_path), "--no-progress"]
        if name == "cegppo":
            env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
            err = run_checked([BIN / "cegppo-eval", *argv], None, env, timeout=600).stderr
        else:
            assert eval_main(argv) == 0
            err = capsys.readouterr().err
        assert "declares its evaluation settings" in err, (name, err[-2000:])
        report = json.loads(report_path.read_text())
        assert report["settings"]["from_checkpoint"] == EVAL_SETTING_NAMES
        assert report["settings"]["instruction"] == demo.DEMO_INSTRUCTION and report["settings"]["temperature"] == 1.0
        (metrics,) = report["datasets"].values()
        k = sizes["eval_samples"]
        assert metrics["num_problems"] == sizes["eval_size"] and metrics["k"] == k == 2
        assert metrics[f"avg@{k}"] == figures[name], (name, metrics[f"avg@{k}"], figures[name])
