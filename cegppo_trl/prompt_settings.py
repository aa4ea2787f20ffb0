"""The prompt and sampling that travel with a saved model: written by `cegppo-train` (into the final model and every
``checkpoint-N``) and `cegppo-demo`, read by `cegppo-eval` and the demo.

A model directory (or LoRA adapter folder) declares its prompt in ``cegppo_prompt.json`` (the instruction and system
prompt) and its sampling in ``generation_config.json`` (the standard place, which `model.generate()` and vLLM also
read). A model without ``cegppo_prompt.json`` takes the paper's evaluation values (`PAPER_SETTINGS`). The prompt words
are one vocabulary for both commands: ``none`` (or "") is no instruction / no system message, ``default`` the
DeepSeek-R1 ``\\boxed{}`` instruction. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from .model_source import holds_model


#: The file in a model directory that declares its prompt format.
PROMPT_FILE = "cegppo_prompt.json"
DEFAULT_TEMPERATURE = 0.6  # the paper's evaluation sampling
DEFAULT_TOP_P = 0.95
DEFAULT_MAX_NEW_TOKENS = 32768  # the paper evaluates DeepSeek-R1-Distill-Qwen-1.5B / 7B with up to 32k tokens
#: The settings a model may declare, at the values of a model that declares none (the paper's evaluation).
PAPER_SETTINGS = {
    "instruction": "default",
    "system_prompt": "",
    "temperature": DEFAULT_TEMPERATURE,
    "top_p": DEFAULT_TOP_P,
    "top_k": 0,
    "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
}


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


#: The one rule of each sampling value, ``name: (ok, what a bad value is told)``: `EvalSettings` and
#: `save_eval_settings` check with it.
SAMPLING_RULES = {
    "temperature": (lambda v: is_number(v) and v >= 0, "must be >= 0 (0 = greedy)"),
    "top_p": (lambda v: is_number(v) and 0 < v <= 1, "must be in (0, 1]"),
    "top_k": (lambda v: is_integer(v) and v >= 0, "must be an integer >= 0 (0 = no cut)"),
    "max_new_tokens": (lambda v: is_integer(v) and v >= 1, "must be an integer >= 1"),
}


def resolve_system_prompt(value: str | None) -> str | None:
    """The system prompt a command-line word means, in `cegppo-train` and `cegppo-eval` alike: ``none`` or ""
    -> None (no system message); any other text -> itself; None stays None."""
    if value is None or value.strip().lower() in ("", "none"):
        return None
    return value


def prompt_word(name: str, value: Any) -> Any:
    """A prompt part as the evaluation stores it: `resolve_instruction` / `resolve_system_prompt` of a word, with
    "" for nothing; other names and non-strings unchanged."""
    if not isinstance(value, str) or name not in ("instruction", "system_prompt"):
        return value
    from .data import resolve_instruction

    return (resolve_instruction if name == "instruction" else resolve_system_prompt)(value) or ""


def save_eval_settings(
    model_dir: str | os.PathLike,
    *,
    instruction: str | None,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int,
    system_prompt: str | None = None,
    note: str | None = None,
    example: Sequence[str] | None = None,
) -> str:
    """Record in a saved model directory (or LoRA adapter folder) how it is prompted and sampled, so that
    `cegppo-eval` uses it by default.

    The prompt (`instruction`, a resolved instruction or ``{problem}`` template, None or "" for none, and
    `system_prompt`, and a worked `example`: problem and answer, before each problem) goes to ``cegppo_prompt.json``; the sampling (`temperature` 0 = greedy, `top_k` 0 = no cut) to
    the directory's ``generation_config.json``. Returns the path of ``cegppo_prompt.json``.
    """
    from transformers import GenerationConfig

    model_dir = os.fspath(model_dir)
    if not holds_model(model_dir):
        raise FileNotFoundError(
            f"{model_dir!r} holds no saved model (no config.json or adapter_config.json); save the model first."
        )
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "max_new_tokens": max_new_tokens}
    for name, value in sampling.items():
        ok, what = SAMPLING_RULES[name]
        if not ok(value):
            raise ValueError(f"save_eval_settings: {name} {what}, got {value!r}.")
    try:
        generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    except OSError:  # no generation_config.json yet (e.g. an adapter folder)
        generation = GenerationConfig()
    generation.max_new_tokens = int(max_new_tokens)
    if temperature > 0:
        generation.update(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=int(top_k))
    else:
        generation.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    generation.save_pretrained(model_dir)
    path = os.path.join(model_dir, PROMPT_FILE)
    prompt = {
        "instruction": instruction or None,
        "system_prompt": system_prompt or None,
        "note": note
        or "Prompt format this model was trained with; cegppo-eval uses it, and the sampling in "
        "generation_config.json, unless --instruction / --system-prompt / --temperature / --top-p / --top-k / "
        "--max-new-tokens are given.",
    }
    if example:
        prompt["example"] = list(example)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(prompt, f, indent=2)
        f.write("\n")
    return path


def load_eval_settings(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The settings `save_eval_settings` recorded in `model_dir`, or None if it has no ``cegppo_prompt.json``.

    Returns ``{"instruction", "system_prompt"}`` ("" for none) plus whichever of ``temperature`` (0 when
    ``do_sample`` is false), ``top_p``, ``top_k`` and ``max_new_tokens`` its ``generation_config.json`` sets.
    """
    from transformers import GenerationConfig

    model_dir = os.path.expanduser(os.fspath(model_dir))
    path = os.path.join(model_dir, PROMPT_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        prompt = json.load(f)
    settings = {name: prompt.get(name) or "" for name in ("instruction", "system_prompt")}
    if os.path.isfile(os.path.join(model_dir, "generation_config.json")):
        generation = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
        casts = {"max_new_tokens": int, "temperature": float, "top_p": float, "top_k": int}
        if generation.do_sample is False:  # greedy
            casts = {"max_new_tokens": int}
            settings["temperature"] = 0.0
        for name, cast in casts.items():
            if getattr(generation, name) is not None:
                settings[name] = cast(getattr(generation, name))
    return settings


def saved_example(model_dirs: Iterable[str | os.PathLike | None]) -> list[str] | None:
    """The worked example (problem, answer) the first of `model_dirs` with a ``cegppo_prompt.json`` declares."""
    for directory in model_dirs:
        path = None if directory is None else os.path.join(os.path.expanduser(os.fspath(directory)), PROMPT_FILE)
        if path is not None and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return json.load(f).get("example")
    return None


def settings_for_model(
    given: dict[str, Any], model_dirs: Iterable[str | os.PathLike | None]
) -> tuple[dict[str, Any], list[str]]:
    """`given` (the names of `PAPER_SETTINGS`, None = not given) with each None filled from the first of `model_dirs`
    that declares its settings, else from `PAPER_SETTINGS`; and the names taken from the model."""
    saved: dict[str, Any] = {}
    for directory in model_dirs:
        if directory is not None and os.path.isdir(os.path.expanduser(os.fspath(directory))):
            saved = load_eval_settings(directory) or {}
            if saved:
                break
    values, from_checkpoint = {}, []
    for name, value in given.items():
        if value is None and saved.get(name) is not None:
            values[name] = saved[name]
            from_checkpoint.append(name)
        else:
            values[name] = prompt_word(name, PAPER_SETTINGS[name] if value is None else value)
    return values, from_checkpoint


def prompt_and_sampling_callback(script_args):
    """A `TrainerCallback` that writes the prompt format and sampling of training (`cegppo-train`'s `script_args`, for
    `cegppo-eval`) into every ``checkpoint-N`` the trainer saves; `cegppo-train` calls its `write` for the final
    model."""
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    class SavePromptAndSampling(TrainerCallback):
        def write(self, path, args):
            example = None if script_args.example_problem is None else (script_args.example_problem,
                                                                         script_args.example_answer)  # fmt: skip
            save_eval_settings(path, instruction=script_args.instruction, system_prompt=script_args.system_prompt,
                               temperature=args.temperature, top_p=args.top_p, top_k=args.top_k or 0,
                               max_new_tokens=args.max_completion_length, example=example)  # fmt: skip

        def on_save(self, args, state, control, **kwargs):
            path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            if args.should_save and os.path.isdir(path):
                self.write(path, args)

    return SavePromptAndSampling()
