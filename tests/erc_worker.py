"""Worker of tests/test_erc_trainer.py: train CEGPPOTrainer with entropy-ratio clipping for two optimizer steps (one
generation batch) per scenario, and record what the old-log-prob pass gave, every micro-batch the loss saw, the metrics
logged and the final parameters.

Run as `python erc_worker.py MODEL_DIR OUT_DIR SCENARIOS_JSON` on one process, or under
`torch.distributed.run --nproc_per_node 2` (DDP over gloo) on two. Rewards depend only on the prompt's `kind` and the
row's position, never on the sampled text: a "flat" prompt's group scores 1.0 everywhere (dropped by dynamic
sampling), a "varied" prompt's alternates 0 / 1.
"""

import json
import sys
import warnings
from pathlib import Path

import torch
from datasets import Dataset

from cegppo_trl import CEGPPOConfig, CEGPPOTrainer


warnings.filterwarnings("ignore")
OLD_LOGP_NOISE = 0.5  # spreads the ratios over every CE-GPPO branch from the first step on
OLD_ENTROPY_NOISE = 0.1  # log-normal factor on the old entropies: ~60% of tokens leave (0.95, 1.05), on both sides


def position_reward(completions, kind, **kwargs):
    return [1.0 if k == "flat" else float(i % 2) for i, k in enumerate(kind)]


def _cloned(batch: dict) -> dict:
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in batch.items()}


class RecordingTrainer(CEGPPOTrainer):
    """Records the old-log-prob pass's output, every micro-batch the loss saw and the metric lists at each log."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generated, self.recorded, self.logged = [], [], []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.generated.append(_cloned(output))  # the old policy's entropies as the trainer computed them
        # Move the old log-probs and entropies away from the current ones, so that every CE-GPPO branch and both sides
        # of the band are populated; the same values reach the loss under test and the oracle (recorded below).
        generator = torch.Generator().manual_seed(1000 + self.accelerator.process_index)
        old = output["old_per_token_logps"]
        output["old_per_token_logps"] = old + OLD_LOGP_NOISE * torch.randn(old.shape, generator=generator)
        entropies = output["cegppo_old_entropies"]
        factor = torch.exp(OLD_ENTROPY_NOISE * torch.randn(entropies.shape, generator=generator))
        output["cegppo_old_entropies"] = entropies * factor
        return output

    def _compute_loss(self, model, inputs):
        self.recorded.append(_cloned(inputs))
        return super()._compute_loss(model, inputs)

    def log(self, logs, start_time=None):
        if "loss" in logs:
            self._device_metrics.flush("train", self._metrics["train"])  # what TRL's `log` is about to average
            self.logged.append({name: list(values) for name, values in self._metrics["train"].items()})
        return super().log(logs, start_time)


def make_config(output_dir: Path, scenario: dict) -> CEGPPOConfig:
    return CEGPPOConfig(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        data_seed=0,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,  # two optimizer steps per generation batch: the second one is off-policy for real
        max_steps=2,
        max_completion_length=6,
        temperature=0.7,  # the entropies are those of softmax(logits / temperature)
        optim="sgd",  # plain SGD, constant lr, no clipping, no decay: the update is lr x gradient
        learning_rate=1.0,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        loss_type="dapo",
        cegppo_entropy_ratio_clip=[0.95, 1.05],
        **scenario["config"],
    )


def run(model_dir: str, out_dir: Path, scenario: dict) -> None:
    args = make_config(out_dir / scenario["name"], scenario)
    kinds = scenario["kinds"]
    dataset = Dataset.from_dict({"prompt": [f"What is {i} + {i}?" for i in range(len(kinds))], "kind": kinds})
    trainer = RecordingTrainer(model=model_dir, reward_funcs=position_reward, args=args, train_dataset=dataset)
    trainer.train()
    rank = trainer.accelerator.process_index
    torch.save(
        {
            "generated": trainer.generated,
            "recorded": trainer.recorded,
            "logged": trainer.logged,
            "final": {n: p.detach().double().clone() for n, p in trainer.model.named_parameters()},
            "world": trainer.accelerator.num_processes,
        },
        out_dir / f"{scenario['name']}.rank{rank}.pt",
    )


def main() -> None:
    model_dir, out_dir, scenarios = sys.argv[1], Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text())
    for scenario in scenarios:
        run(model_dir, out_dir, scenario)


if __name__ == "__main__":
    main()
