"""A reward for the GPU check's recipe runs on random-init models: it splits some groups and leaves others uniform.

A random model gets every math answer wrong (`math` is -1 throughout: no gradient, nothing for dynamic sampling to
remove). Added to `math` (`--reward_funcs math split_reward.split_groups`, this folder on PYTHONPATH), it gives +2 or
0 by a CRC of the completion for about half of the prompts (a split group at +1 / -1; +1 gets the SFT term where a
recipe turns it on) and 0 for the others (a uniform -1 group, which `cegppo_exclude_zero_advantage_groups` must leave
out). Deterministic (CRC-32, no random state), so every process of a run and every rerun agree.
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
