"""`load_log_history`, `plot_log_histories` and the `cegppo-plot` command."""

import json
import math

import matplotlib.image
import numpy as np
import pytest
from matplotlib.colors import to_rgb

from cegppo_trl.demo.plotting import DEFAULT_METRICS, _series, load_log_history, main, plot_log_histories
from cegppo_trl.demo.toy import ToyConfig


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def fake_history(steps=20, scale=1.0, quadrants=True):
    history = []
    for step in range(1, steps + 1):
        entry = {
            "step": step,
            "loss": 0.1,
            "reward": scale * math.tanh(step / 10),
            "entropy": 1.0 / step,
            "clip_ratio/region_mean": 0.01 * (step % 3),
            "cegppo/beta1_token_frac": 0.005,
            "cegppo/beta2_token_frac": 0.002,
        }
        if quadrants:
            for q in ("pos_high", "pos_low", "neg_high", "neg_low"):
                entry[f"cegppo/quadrant/{q}/token_frac"] = 0.2
        history.append(entry)
    history.append({"step": steps, "train_runtime": 1.0, "train_loss": 0.1})  # the trainer's final summary entry
    return history


def write_state(directory, history):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "trainer_state.json").write_text(
        json.dumps({"global_step": history[-1]["step"], "log_history": history})
    )
    return directory


def png_shape(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    return matplotlib.image.imread(path).shape


def colour_pixels(path, colour) -> int:
    """How many pixels of the image are within a small distance of a matplotlib colour."""
    pixels = (matplotlib.image.imread(path)[..., :3] * 255).astype(float)
    return int((np.abs(pixels - 255 * np.array(to_rgb(colour))).max(-1) < 12).sum())


def run_colours(path):
    """Which runs' line colours (matplotlib's first two cycle colours: run 1, run 2) the image shows."""
    return {colour for colour in ("C0", "C1") if colour_pixels(path, colour) > 20}


def test_load_log_history_accepts_run_checkpoint_and_file(tmp_path):
    h2, h6, h10 = fake_history(2), fake_history(6), fake_history(10)
    run = tmp_path / "run"
    write_state(run / "checkpoint-2", h2)
    write_state(run / "checkpoint-10", h10)  # numerically, not lexically, the latest
    write_state(run / "checkpoint-6", h6)
    assert load_log_history(run) == h10  # no trainer_state.json of its own: the latest checkpoint's
    assert load_log_history(run / "checkpoint-6") == h6
    assert load_log_history(run / "checkpoint-2" / "trainer_state.json") == h2
    write_state(run, h6)
    assert load_log_history(str(run)) == h6  # the run's own file wins
    bare = tmp_path / "history.json"
    bare.write_text(json.dumps(h2))
    assert load_log_history(bare) == h2
    with pytest.raises(FileNotFoundError):
        load_log_history(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        load_log_history(tmp_path / "empty")


def test_plot_skips_non_finite_and_non_numeric_values(tmp_path):
    history = fake_history(5)
    history[1]["reward"] = float("nan")
    history[2]["reward"] = "n/a"
    history[3]["reward"] = True
    path = plot_log_histories({"a": history}, tmp_path / "p.png", metrics=["reward"])
    assert png_shape(path)[0] > 0 and run_colours(path) == {"C0"}
    assert _series(history, "reward") == ([1, 5], [math.tanh(0.1), math.tanh(0.5)])


def test_cli_one_and_two_runs(tmp_path, capsys):
    """`cegppo-plot`: one run; two runs (the second a checkpoint's state without the quadrant metrics) with labels and
    a title, into a new folder; chosen metrics, absent ones skipped. Bad input is one line and exit 2."""
    run_a = write_state(tmp_path / "a", fake_history())
    write_state(tmp_path / "b" / "checkpoint-4", fake_history(4, 2.0, quadrants=False))
    out, out2, out3 = tmp_path / "plot.png", tmp_path / "sub" / "plot2.png", tmp_path / "plot3.png"
    assert main([str(run_a), "--out", str(out)]) == 0
    two = [str(run_a), str(tmp_path / "b"), "--out", str(out2), "--labels", "grpo", "cegppo", "--title", "t"]
    assert main(two) == 0
    assert main([str(run_a), "--out", str(out3), "--metrics", "reward", "missing"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"wrote {path}" for path in (out, out2, out3)]
    for path in (out, out2):
        height, width = png_shape(path)[:2]
        assert height > 100 and width > 100
    assert run_colours(out) == {"C0"} == run_colours(out3) and run_colours(out2) == {"C0", "C1"}  # a colour per run
    # Default metrics present: 5 + 4 quadrant token fractions = 9 panels (3 rows), against one panel (one row).
    assert len(DEFAULT_METRICS) > 9 and png_shape(out)[0] > 2 * png_shape(out3)[0]
    for argv, message in (
        ([*two[:4], "--labels", "x"], "--labels needs one distinct label per run"),
        ([str(tmp_path / "missing"), "--out", str(out2)], "does not exist"),
        ([str(run_a), "--out", str(out2), "--metrics", "not/logged"], "Logged metrics"),
    ):
        with pytest.raises(SystemExit) as error:
            main(argv)
        err = capsys.readouterr().err
        assert error.value.code == 2 and message in err and "Traceback" not in err, (argv, err)
    with pytest.raises(ValueError, match="needs at least one run"):
        plot_log_histories({}, tmp_path / "x.png")


def test_demo_toy_figure_draws_every_setting(tmp_path):
    from cegppo_trl.demo.plotting import SETTING_COLORS, plot_toy_grid
    from cegppo_trl.demo.toy import run_toy_grid

    toy = {"runs": run_toy_grid(seeds=[0], config=ToyConfig(steps=5))}
    path = plot_toy_grid(toy["runs"], tmp_path / "toy.png", title="toy")
    height, width = png_shape(path)[:2]
    assert width > 2 * height  # three panels side by side
    for setting, colour in SETTING_COLORS.items():
        assert colour_pixels(path, colour) > 20, setting
    only_two = plot_toy_grid([r for r in toy["runs"] if r["beta1"] == 0.0], tmp_path / "two.png")
    assert colour_pixels(only_two, SETTING_COLORS[(1.0, 1.0)]) == 0
