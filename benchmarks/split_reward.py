"""A reward for the GPU check's recipe runs on random-init models: it splits some groups and leaves others uniform.

A random-init model gets every math answer wrong, so the recipes' `math` reward is -1 for every completion: every
group is uniform, every advantage is 0, and the run neither trains nor exercises dynamic sampling. Added to `math`
(`--reward_funcs math split_reward.split_groups`, with this folder on PYTHONPATH), `split_groups` gives:

* for about half of the prompts (chosen by a CRC of the prompt's text): +2 or 0 by a CRC of the completion's text, so
  the total reward is +1 or -1 (the paper's two values) and the group is split: it trains, and completions at +1 get
  the SFT term when a recipe turns it on (`cegppo_sft_reward_threshold` 1.0);
* for the other prompts: 0, so the total is -1 for the whole group: a uniform group, which dynamic sampling
  (`cegppo_exclude_zero_advantage_groups`) must leave out.

Deterministic (CRC-32, no random state), so every process of a run and every rerun agree.
"""

from __future__ import annotations

import zlib


def _text(value) -> str:
    """The text of a prompt or completion: a string, or the contents of a conversational list of messages."""
    if isinstance(value, str):
        return value
    return "".join(str(message.get("content", "")) for message in value)


def _crc_bit(text: str) -> int:
    return zlib.crc32(text.encode("utf-8")) % 2


def prompt_is_split(prompt) -> bool:
    """Whether `split_groups` splits the group of `prompt` (about half of the prompts)."""
    return _crc_bit("prompt:" + _text(prompt)) == 1


def split_groups(completions, prompts=None, **kwargs) -> list[float]:
    """+2 / 0 by the completion's CRC for split prompts (`prompt_is_split`), 0 for the others (TRL reward signature)."""
    if prompts is None:
        prompts = [""] * len(completions)
    rewards = []
    for prompt, completion in zip(prompts, completions):
        lucky = prompt_is_split(prompt) and _crc_bit(_text(completion)) == 1
        rewards.append(2.0 if lucky else 0.0)
    return rewards
