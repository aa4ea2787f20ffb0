"""Worker of tests/test_callback_multiprocess.py: train the tiny model one step with `AvgAtKCallback` (on start and
after each step) and record, on each process, what it generated, the figures it logged and what another callback's
`on_log` received. Run as `python avg_at_k_worker.py MODEL_DIR HELDOUT_JSONL OUT_DIR` under `torch.distributed.run
--nproc_per_node N` (gloo on CPU). The model is the quick demo's warm start, which solves some of its held-out
problems, so the figures are not trivially 0."""

import json
import sys
import warnings
from pathlib import Path

from datasets import Dataset
from shared import TINY_INSTRUCTION, cpu_config
from transformers import AutoTokenizer, TrainerCallback

from cegppo_trl import AvgAtKCallback, CEGPPOConfig, CEGPPOTrainer, load_math_dataset


def length_reward(completions, **kwargs):
    """Reward depending on the text only, so that groups have non-zero advantages."""
    return [float(len(c[0]["content"]) % 3) for c in completions]


class Recorder(TrainerCallback):
    """What a report_to integration sees (every `on_log`, with its step) and the callback's share at each of its
    entries (also tests/test_evaluation.py's recorder, on one process)."""

    def __init__(self, callback):
        self.callback, self.logs, self.shares = callback, [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({"step": state.global_step, **logs})
        if any(key.startswith("heldout/") for key in logs):
            self.shares.append(list(self.callback.last_share))


def main(model_dir: str, heldout: str, out_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "solution": str(a + b)} for a in range(8) for b in range(8)]
    )  # fmt: skip
    config = cpu_config(CEGPPOConfig, out_dir, per_device_train_batch_size=4, max_completion_length=20,
                        steps_per_generation=2, max_steps=1, learning_rate=1e-3)  # fmt: skip
    trainer = CEGPPOTrainer(
        model=model_dir, reward_funcs=length_reward, args=config, train_dataset=train, processing_class=tokenizer
    )
    held_out = load_math_dataset(heldout, instruction=TINY_INSTRUCTION).select(range(30))
    callback = AvgAtKCallback(trainer, held_out, k=4, eval_steps=1, batch_size=16, eval_on_start=True, temperature=1.0)
    recorder = Recorder(callback)
    trainer.add_callback(callback)
    trainer.add_callback(recorder)
    trainer.train()
    result = {
        "world_size": trainer.accelerator.num_processes,
        "rank": trainer.accelerator.process_index,
        "chunks": callback.chunks(),
        "history": callback.history,
        "shares": recorder.shares,
        "on_log": [log for log in recorder.logs if any(key.startswith("heldout/") for key in log)],
    }
    Path(out_dir, f"rank{result['rank']}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    main(*sys.argv[1:4])
