"""avg@k / pass@k: the estimator against brute force, grading, the `cegppo-eval` command on a tiny local model, and
the in-training `AvgAtKCallback` under CEGPPOTrainer."""

import copy
import itertools
import json
from math import comb

import pytest
import torch

from cegppo_trl import CEGPPOConfig, CEGPPOTrainer
from cegppo_trl.evaluation import AvgAtKCallback, evaluate_completions, format_summary, main, pass_at_k


# The tiny model is SFT-trained on this user message format (cegppo_trl.demo.run.DEMO_INSTRUCTION).
TINY_INSTRUCTION = "{problem} Put the final answer in \\boxed{}."


def brute_force_pass_at_k(outcomes, k):
    """Fraction of the k-subsets of the samples that contain at least one correct sample."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_brute_force(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(outcomes, k), abs=1e-12), (n, c, k)
            assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_edge_cases_and_large_n():
    assert pass_at_k(32, 0, 32) == 0.0 and pass_at_k(32, 1, 32) == 1.0
    assert pass_at_k(32, 8, 1) == pytest.approx(8 / 32)  # pass@1 is the plain accuracy
    assert pass_at_k(1000, 3, 500) == pytest.approx(1 - comb(997, 500) / comb(1000, 500))
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_evaluate_completions_grades_and_averages():
    completions = [
        ["so \\boxed{12}", "\\boxed{13}", "12", "no answer here"],  # 2 correct ("12" ends the text)
        ["\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{1/2}", "\\boxed{2}"],  # 3 correct
        ["\\boxed{7}"] * 4,  # 0 correct
    ]
    solutions = ["12", "\\frac{1}{2}", "8"]
    report = evaluate_completions(completions, solutions, pass_ks=[1, 2, 4])
    assert report["num_correct"] == [2, 3, 0]
    assert report["avg@4"] == pytest.approx(5 / 12)
    assert report["pass@1"] == pytest.approx(5 / 12)
    outcomes = [[True, False, True, False], [True, True, True, False], [False] * 4]
    for k in (2, 4):
        expected = sum(brute_force_pass_at_k(o, k) for o in outcomes) / 3
        assert report[f"pass@{k}"] == pytest.approx(expected)
    assert report["status_counts"]["correct"] == 5 and report["status_counts"]["no_answer"] >= 1
    line = format_summary("toy", report)
    assert line.startswith("toy: avg@4 = 41.7% | pass@1 = 41.7% | pass@2 = ") and "3 problems x 4 samples" in line
    with pytest.raises(ValueError):
        evaluate_completions(completions, solutions, pass_ks=[5])
    with pytest.raises(ValueError):
        evaluate_completions([["a"], ["b", "c"]], ["1", "2"])


def test_cegppo_eval_writes_json_report(tiny_model, tiny_tokenizer, tmp_path, capsys):
    from cegppo_trl.demo.tiny import save_tiny

    model_dir = save_tiny(tiny_model, tiny_tokenizer, tmp_path / "model")
    data = tmp_path / "probs.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {a}+1?", "answer": str(a + 1)}) + "\n" for a in range(3)))
    out = tmp_path / "reports" / "eval.json"
    argv = [
        model_dir,
        "--datasets",
        "builtin:arithmetic_eval",
        str(data),
        "--max-problems",
        "4",
        "--k",
        "3",
        "--pass-k",
        "1",
        "2",
        "3",
        "--max-new-tokens",
        "6",
        "--batch-size",
        "5",
        "--instruction",
        TINY_INSTRUCTION,
        "--device",
        "cpu",
        "--output",
        str(out),
        "--save-completions",
        "--no-progress",
    ]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["model"] == model_dir and report["settings"]["k"] == 3
    assert report["settings"]["temperature"] == 0.6 and report["settings"]["top_p"] == 0.95
    assert list(report["datasets"]) == ["builtin:arithmetic_eval", str(data)]
    for name, n in (("builtin:arithmetic_eval", 4), (str(data), 3)):
        metrics = report["datasets"][name]
        assert metrics["num_problems"] == n and len(metrics["problems"]) == n
        counts = [p["num_correct"] for p in metrics["problems"]]
        assert metrics["avg@3"] == pytest.approx(sum(counts) / (3 * n))
        for j in (1, 2, 3):
            assert metrics[f"pass@{j}"] == pytest.approx(sum(pass_at_k(3, c, j) for c in counts) / n)
        assert metrics["status_counts"].get("correct", 0) == sum(counts)
        assert metrics["pass@1"] == pytest.approx(metrics["avg@3"])
        assert all(len(p["completions"]) == 3 and 0 <= p["num_correct"] <= 3 for p in metrics["problems"])
        assert sum(metrics["status_counts"].values()) == 3 * n
    assert report["datasets"][str(data)]["problems"][2]["solution"] == "3"
    assert "Put the final answer" in report["datasets"][str(data)]["problems"][0]["problem"]
    lines = [line for line in capsys.readouterr().out.splitlines() if ": avg@" in line]  # (deepspeed may log too)
    assert len(lines) == 2 and lines[0].startswith("builtin:arithmetic_eval: avg@3 = ")
    assert lines[1].startswith(f"{data}: avg@3 = ") and "(3 problems x 3 samples" in lines[1]

    # Same seed, same samples: the report is reproducible.
    out2 = tmp_path / "eval2.json"
    assert main(argv[:-4] + ["--output", str(out2), "--save-completions", "--no-progress"]) == 0
    again = json.loads(out2.read_text())
    for name in report["datasets"]:
        assert [p["completions"] for p in again["datasets"][name]["problems"]] == [
            p["completions"] for p in report["datasets"][name]["problems"]
        ]


def test_cegppo_eval_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        main(["some-model", "--datasets", "builtin:arithmetic_eval", "--k", "2", "--pass-k", "3"])
    with pytest.raises(SystemExit) as error:  # unknown local model directory: a clean error, no traceback
        main([str(tmp_path / "missing"), "--datasets", "builtin:arithmetic_eval", "--output", str(tmp_path / "x")])
    assert error.value.code == 2


def test_avg_at_k_callback_logs_into_history_without_changing_training(
    tiny_model, tiny_tokenizer, arithmetic_dataset, reward_fn, make_config, tmp_path
):
    from cegppo_trl.data import load_math_dataset
    from cegppo_trl.demo.plotting import load_log_history, plot_log_histories

    held_out = load_math_dataset("builtin:arithmetic_eval", instruction=TINY_INSTRUCTION).select(range(3))
    reference_model = copy.deepcopy(tiny_model)

    def train(model, callbacks, output_dir):
        config = make_config(CEGPPOConfig, output_dir, max_steps=2)
        trainer = CEGPPOTrainer(
            model=model,
            reward_funcs=reward_fn,
            args=config,
            train_dataset=arithmetic_dataset,
            processing_class=tiny_tokenizer,
            callbacks=callbacks,
        )
        trainer.train()
        return trainer

    callback = AvgAtKCallback(held_out, k=2, eval_steps=1, max_new_tokens=4, batch_size=6, eval_on_start=True)
    trainer = train(tiny_model, [callback], tmp_path / "with")
    entries = [h for h in trainer.state.log_history if "heldout/avg@2" in h]
    assert [e["step"] for e in entries] == [0, 1, 2]  # on start, then every step; no duplicate at the end
    for e in entries:
        assert 0.0 <= e["heldout/avg@2"] <= e["heldout/pass@2"] <= 1.0
        assert e["heldout/pass@1"] == pytest.approx(e["heldout/avg@2"])
    assert callback.history == entries
    trainer.save_state()
    history = load_log_history(tmp_path / "with")
    assert [h["step"] for h in history if "heldout/avg@2" in h] == [0, 1, 2]
    png = plot_log_histories({"run": history}, tmp_path / "heldout.png", metrics=["heldout/avg@2", "reward"])
    assert (tmp_path / "heldout.png").stat().st_size > 0 and png.endswith("heldout.png")

    # The evaluation runs under its own RNG: training with and without it ends with the same weights.
    reference = train(reference_model, [], tmp_path / "without")
    for (name, p), q in zip(trainer.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(p.detach(), q.detach()), name
    assert trainer.model.training == reference.model.training


def test_avg_at_k_callback_validates_rows():
    with pytest.raises(ValueError):
        AvgAtKCallback([{"problem": "1+1", "answer": "2"}])
    with pytest.raises(ValueError):
        AvgAtKCallback([], k=2)


@pytest.mark.parametrize(
    "name",
    ["missing-dir/model", "./model", "~/no/such/model/here", "out/runs/cegppo/final", "not a hub id"],
)
def test_cegppo_eval_names_a_missing_local_path(name, tmp_path, monkeypatch, capsys):
    """A local path that does not exist is reported as such, not as Hugging Face's "Repo id must be ..." error."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "missing-dir").mkdir()  # an existing parent: "missing-dir/model" is a path, not a Hub id
    with pytest.raises(SystemExit) as error:
        main([name, "--datasets", "builtin:arithmetic_eval", "--output", str(tmp_path / "x.json")])
    assert error.value.code == 2
    message = capsys.readouterr().err
    assert f"model path {name!r} does not exist" in message and "Repo id" not in message


def test_cegppo_eval_names_a_directory_without_a_model(tiny_model, tiny_tokenizer, tmp_path, capsys):
    from cegppo_trl.demo.tiny import save_tiny

    run = tmp_path / "run"
    save_tiny(tiny_model, tiny_tokenizer, run / "final")
    (run / "trainer_state.json").write_text("{}")
    with pytest.raises(SystemExit) as error:
        main([str(run), "--datasets", "builtin:arithmetic_eval", "--output", str(tmp_path / "x.json")])
    assert error.value.code == 2
    message = capsys.readouterr().err
    assert "holds no saved model (no config.json)" in message and str(run / "final") in message


def test_eval_settings_travel_with_the_checkpoint(tiny_model, tiny_tokenizer, tmp_path, capsys):
    """`save_eval_settings` writes cegppo_prompt.json + generation_config.json; `cegppo-eval` uses them when no flag
    is given (and says so), explicit flags win, and a model without the file keeps the paper's defaults."""
    from cegppo_trl.data import DEFAULT_INSTRUCTION
    from cegppo_trl.demo.tiny import load_tiny, save_tiny
    from cegppo_trl.evaluation import PROMPT_FILE, load_eval_settings, resolve_eval_settings, save_eval_settings

    plain = save_tiny(tiny_model, tiny_tokenizer, tmp_path / "plain")
    assert load_eval_settings(plain) is None
    assert resolve_eval_settings(plain) == (
        {
            "instruction": DEFAULT_INSTRUCTION,
            "system_prompt": None,
            "temperature": 0.6,
            "top_p": 0.95,
            "max_new_tokens": 1024,
        },
        [],
    )
    model_dir = save_tiny(tiny_model, tiny_tokenizer, tmp_path / "model")
    save_eval_settings(model_dir, instruction=TINY_INSTRUCTION, temperature=1.0, top_p=1.0, max_new_tokens=6)
    assert (tmp_path / "model" / PROMPT_FILE).is_file()
    saved = {"instruction": TINY_INSTRUCTION, "system_prompt": None, "temperature": 1.0, "top_p": 1.0}
    assert load_eval_settings(model_dir) == {**saved, "max_new_tokens": 6}
    model, _ = load_tiny(model_dir)  # the standard place: plain `generate` samples the same way
    assert model.generation_config.do_sample and model.generation_config.max_new_tokens == 6
    assert model.generation_config.temperature == 1.0 and model.generation_config.top_k == 0
    settings, used = resolve_eval_settings(model_dir, temperature=0.0, instruction="default")
    assert settings == {**saved, "instruction": DEFAULT_INSTRUCTION, "temperature": 0.0, "max_new_tokens": 6}
    assert used == ["system_prompt", "top_p", "max_new_tokens"]

    data = tmp_path / "probs.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {a}+1?", "answer": str(a + 1)}) + "\n" for a in range(3)))
    base = [model_dir, "--datasets", str(data), "--k", "2", "--device", "cpu", "--no-progress", "--save-completions"]
    assert main([*base, "--output", str(tmp_path / "auto.json")]) == 0
    assert "declares its evaluation settings" in capsys.readouterr().err
    report = json.loads((tmp_path / "auto.json").read_text())
    assert report["settings"]["from_checkpoint"] == ["instruction", "system_prompt", "temperature", "top_p",
                                                     "max_new_tokens"]  # fmt: skip
    assert {k: report["settings"][k] for k in saved} == saved and report["settings"]["max_new_tokens"] == 6
    (problem,) = report["datasets"][str(data)]["problems"][:1]
    assert problem["problem"] == "What is 0+1? Put the final answer in \\boxed{}."
    flags = ["--instruction", "default", "--temperature", "0.6", "--top-p", "0.9", "--max-new-tokens", "4"]
    assert main([*base, *flags, "--system-prompt", "Be brief.", "--output", str(tmp_path / "flags.json")]) == 0
    assert "declares" not in capsys.readouterr().err
    settings = json.loads((tmp_path / "flags.json").read_text())["settings"]
    assert settings["from_checkpoint"] == [] and settings["instruction"] == DEFAULT_INSTRUCTION
    assert (settings["temperature"], settings["top_p"], settings["max_new_tokens"]) == (0.6, 0.9, 4)
    assert settings["system_prompt"] == "Be brief."
