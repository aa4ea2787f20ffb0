"""A reward function that records what the trainer generated, for the real-model tier's assertions.

`cegppo-train --reward_funcs math format completion_log.record_completions` (with this folder on PYTHONPATH) loads it
as a user's own reward (a dotted path). It returns 0.0 for every completion (a constant adds nothing to any
advantage) and appends, per completion, the step, the prompt as the trainer got it, the decoded completion and its
token ids (TRL passes them: up to and including the first EOS) to ``$COMPLETION_LOG_DIR/rank-<RANK>.jsonl``.
"""

import json
import os


def record_completions(prompts, completions, completion_ids, trainer_state, **kwargs):
    folder = os.environ["COMPLETION_LOG_DIR"]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank-{os.environ.get('RANK', '0')}.jsonl")
    with open(path, "a", encoding="utf-8") as f:
        for prompt, completion, ids in zip(prompts, completions, completion_ids, strict=True):
            row = {"step": trainer_state.global_step, "prompt": prompt, "completion": completion, "ids": list(ids)}
            f.write(json.dumps(row) + "\n")
    return [0.0] * len(prompts)
