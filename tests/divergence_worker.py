"""Worker of tests/test_divergence_launch.py (whose trainer and reward tests/test_divergence.py also uses): train
with the loss of process 1 made NaN at chosen optimizer steps, per scenario; each process writes where it stopped (or
what it skipped) to `<scenario>.rank<N>.json`. Run as `python divergence_worker.py MODEL_DIR OUT_DIR` on two processes.
"""

import json
import math
import sys
import warnings
from pathlib import Path

import torch
from shared import cpu_config

from cegppo_trl import CEGPPOConfig, CEGPPOTrainer, load_math_dataset
from cegppo_trl.divergence import NonFiniteStepError


NAN_RANK = 1
RUN = dict(learning_rate=0.05, save_strategy="steps", save_steps=1)  # on shared.cpu_config (test_divergence's too)
SCENARIOS = {
    # The first non-finite step (step 3, on rank 1 only): both processes stop there, before applying it.
    "stop": dict(nan_steps=[3], config=dict(cegppo_entropy_target=1.0)),
    "stop-lora": dict(nan_steps=[3], config={}, peft=True),
    # Skip one (step 2) and count it, then stop at the next (step 4); dynamic sampling and the controller on.
    "skip": dict(
        nan_steps=[2, 4],
        config=dict(
            cegppo_max_skipped_steps=1,
            cegppo_entropy_target=1.0,
            cegppo_exclude_zero_advantage_groups=True,
            cegppo_oversampling=2.0,
        ),
    ),
}


class Injecting(CEGPPOTrainer):
    """Makes the loss of process `nan_rank` NaN at the optimizer steps in `nan_steps` (1-based)."""

    nan_steps: tuple = ()
    nan_rank: int = 0

    def _cegppo_loss_delta(self, *args, **kwargs):
        delta = super()._cegppo_loss_delta(*args, **kwargs)
        step = self.state.global_step + 1
        if self.model.training and step in self.nan_steps and self.accelerator.process_index == self.nan_rank:
            delta = delta * math.nan
        return delta


def varied_reward(completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]  # every group informative: a gradient at every step


def lora(peft: bool) -> dict:
    from peft import LoraConfig

    return {"peft_config": LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])} if peft else {}


def run(model_dir: str, out_dir: Path, name: str, scenario: dict) -> None:
    args = cpu_config(CEGPPOConfig, out_dir / name, **RUN, **scenario["config"])
    extra = lora(scenario.get("peft", False))
    data = load_math_dataset("builtin:arithmetic").select(range(64))
    trainer = Injecting(model=model_dir, reward_funcs=varied_reward, args=args, train_dataset=data, **extra)
    trainer.nan_steps, trainer.nan_rank = scenario["nan_steps"], NAN_RANK
    record = {"error": None}
    try:
        trainer.train()
    except NonFiniteStepError as error:
        record.update(error=str(error), error_step=error.step)
    trainable = [p.detach().float() for p in trainer.model.parameters() if p.requires_grad]
    record.update(
        global_step=trainer.state.global_step,
        skipped=trainer._step_guard.skipped,
        checkpoints=sorted(p.name for p in (out_dir / name).glob("checkpoint-*")),
        controller=None if trainer._controller is None else vars(trainer._controller),
        # ZeRO-3 holds each parameter's shard in `ds_tensor`; the others the whole (replicated) parameter
        weight_sum=sum(float(getattr(p, "ds_tensor", p).detach().double().sum()) for p in trainer.model.parameters()),
        finite=bool(all(torch.isfinite(p).all() for p in trainable)),
    )
    rank = trainer.accelerator.process_index
    (out_dir / f"{name}.rank{rank}.json").write_text(json.dumps(record))
    trainer.accelerator.wait_for_everyone()


def main() -> None:
    warnings.filterwarnings("ignore")
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    for name, scenario in SCENARIOS.items():
        run(model_dir, out_dir, name, scenario)


if __name__ == "__main__":
    main()
