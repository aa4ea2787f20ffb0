"""The commands compose: `cegppo-demo` (through `cegppo-compare`) leaves the start model and every trained model with
its prompt format and sampling settings, and `cegppo-eval` on a saved model, run as the demo prints it (no prompt or
sampling flags), reproduces the comparison's own held-out figure.

The demo is the shared quick run of conftest.py (`quick_demo`: the quick demo, whose 150 SFT steps leave the warm
start solving ~10% of the held-out sums, so the figures are not trivially 0 or 1, with 4 RL steps and 2 samples per
problem), made by the installed wheel's `cegppo-demo` in a subprocess with one thread."""

import json
import os
import shlex

import pytest
from shared import BIN, EVAL_SETTING_NAMES, assert_saved_settings, run_checked

from cegppo_trl import prompt_settings
from cegppo_trl.demo.run import DEMO_INSTRUCTION, HELDOUT_FILE
from cegppo_trl.tiny_model import load_rows


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture
def demo_run(quick_demo, monkeypatch):
    """The shared quick demo; the commands it printed name paths relative to the directory it ran in."""
    monkeypatch.chdir(quick_demo.cwd)
    return quick_demo.out, quick_demo.summary


def _figures(out, summary) -> dict[str, float]:
    """The comparison's held-out avg@k of each model the demo printed a command for (its cegppo-eval report)."""
    folders = {"start": out / "lm" / "start"}
    folders.update({r["arm"]: out / "lm" / "runs" / r["name"] for r in summary["lm"]["runs"] if r["seed"] == 0})
    k = summary["sizes"]["eval_samples"]
    return {n: next(iter(json.loads((f / "eval-boxed.json").read_text())["datasets"].values()))[f"avg@{k}"]
            for n, f in folders.items()}  # fmt: skip


def test_demo_saves_every_model_with_its_prompt_format(demo_run):
    out, summary = demo_run
    for path in (out / "lm" / "start-model", out / "lm" / "runs" / "cegppo-seed0", out / "lm" / "runs" / "grpo-seed0"):
        assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file(), path
        assert_saved_settings(path, DEMO_INSTRUCTION, temperature=1.0, max_new_tokens=20)
    rows = [json.loads(line) for line in (out / HELDOUT_FILE).read_text().splitlines()]
    assert rows == load_rows("builtin:arithmetic_eval", summary["sizes"]["eval_size"])
    figures = _figures(out, summary)
    assert 0 < figures["start"] < 1, figures  # not trivially all wrong or all right


def test_cegppo_eval_reproduces_the_demo_figures(demo_run, tmp_path, capsys):
    """Each printed command, run with no prompt or sampling flags, gives exactly the comparison's figure: nothing but
    the model directory carries the settings. The CE-GPPO model's command runs as a user runs it, the console script
    in a fresh process with one thread; the start's and GRPO's through the same `main` in this process."""
    from cegppo_trl.scripts.eval import main as eval_main

    out, summary = demo_run
    k = summary["sizes"]["eval_samples"]
    figures = _figures(out, summary)
    assert set(summary["eval_commands"]) == set(figures) == {"start", "cegppo", "grpo"}
    capsys.readouterr()
    for name, command in summary["eval_commands"].items():
        words = shlex.split(command)
        assert words[0] == "cegppo-eval" and "--instruction" not in words and "--temperature" not in words
        assert os.path.isfile(os.path.join(words[1], prompt_settings.PROMPT_FILE)), (name, words[1])
        assert os.path.samefile(words[3], out / HELDOUT_FILE), (name, words[3])
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
        assert report["settings"]["instruction"] == DEMO_INSTRUCTION and report["settings"]["temperature"] == 1.0
        (metrics,) = report["datasets"].values()
        assert metrics["num_problems"] == summary["sizes"]["eval_size"] and metrics["k"] == k == 2
        assert metrics[f"avg@{k}"] == figures[name], (name, metrics[f"avg@{k}"], figures[name])
