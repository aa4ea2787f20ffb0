"""Worker of tests/test_dynamic_sampling.py and tests/test_erc_trainer.py: train CEGPPOTrainer for two optimizer steps
(one generation batch) per scenario and record the generation batch (before and after the selection of the training
rows, with dynamic sampling), every micro-batch the loss saw, the metrics it logged and the final parameters.

Run as `python training_worker.py MODEL_DIR OUT_DIR SCENARIOS_JSON` on one process, or under
`torch.distributed.run --nproc_per_node 2` (DDP over gloo) or `accelerate launch` with a ZeRO / FSDP2 config on two.
Rewards depend only on the prompt's `kind` and the row's position, never on the sampled text, so which groups are
dropped is the same on every machine: a "flat" prompt's group scores 1.0 everywhere (dropped), a "varied" prompt's
alternates 0 / 1 (kept, and its 1s get the SFT term).
"""

import json
import sys
import warnings
from pathlib import Path

import torch
from datasets import Dataset

from cegppo_trl import CEGPPOConfig, CEGPPOTrainer


OLD_LOGP_NOISE = 0.5  # spreads the ratios over every CE-GPPO branch (both clipped sets) from the first step on
OLD_ENTROPY_NOISE = 0.1  # log-normal factor on the old entropies: ~60% of tokens leave (0.95, 1.05), on both sides
BASE = dict(
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
    temperature=1.0,
    optim="sgd",  # plain SGD, constant lr, no clipping, no decay: the update is lr x gradient, so scale shows
    learning_rate=2.0,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    max_grad_norm=0.0,
)


def position_reward(completions, kind, **kwargs):
    return [1.0 if k == "flat" else float(i % 2) for i, k in enumerate(kind)]


def _cloned(batch: dict) -> dict:
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in batch.items()}


def _log_probs(trainer, batch: dict) -> torch.Tensor:
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, batch["completion_ids"].size(1), batch_size=4
        )
    return logps


class RecordingTrainer(CEGPPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generated, self.recorded, self.logged, self.selections = [], [], [], []

    def _select_training_rows(self, output, rewards, mode):
        generated = _cloned(output)
        if "old_per_token_logps" not in output:  # select first, then compute: the old log-probs of every generated
            generated["old_per_token_logps"] = _log_probs(self, output)  # row, here only to check the selection
        selected, selection = super()._select_training_rows(output, rewards, mode)
        self.selections.append({"generated": generated, "rewards": rewards.clone(), "rows": selection.rows.clone()})
        return selected, selection

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.generated.append(_cloned(output))  # as the trainer computed it (old log-probs and entropies included)
        if "cegppo_keep" in output:
            self.selections[-1]["trained"] = self.generated[-1]
        # Move the old log-probs (and entropies) away from the current ones; the same values reach the loss under test
        # and the reference (recorded below).
        generator = torch.Generator().manual_seed(1000 + self.accelerator.process_index)
        old = output["old_per_token_logps"]
        output["old_per_token_logps"] = old + OLD_LOGP_NOISE * torch.randn(old.shape, generator=generator)
        if "cegppo_old_entropies" in output:
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


def make_dataset(scenario: dict) -> Dataset:
    kinds = scenario["kinds"]
    return Dataset.from_dict({"prompt": [f"What is {i} + {i}?" for i in range(len(kinds))], "kind": kinds})


def make_config(output_dir: Path, scenario: dict, exclude: bool = True) -> CEGPPOConfig:
    """`BASE` with the scenario's `config`; a scenario with an `oversampling` is a dynamic-sampling one (`exclude`)."""
    values = dict(BASE, output_dir=str(output_dir))
    if "oversampling" in scenario:
        values.update(
            cegppo_exclude_zero_advantage_groups=exclude,
            cegppo_oversampling=scenario["oversampling"] if exclude else 1.0,
        )
    return CEGPPOConfig(**dict(values, **scenario["config"]))


def run(model_dir: str, out_dir: Path, scenario: dict) -> None:
    args = make_config(out_dir / scenario["name"], scenario)
    trainer = RecordingTrainer(
        model=model_dir, reward_funcs=position_reward, args=args, train_dataset=make_dataset(scenario)
    )
    trainer.train()
    rank = trainer.accelerator.process_index
    # The full parameters also under ZeRO-3 / FSDP2, where each process holds a shard (ZeRO-3 gives them to rank 0).
    full_state = trainer.accelerator.get_state_dict(trainer.model_wrapped) or {}
    torch.save(
        {
            "generated": trainer.generated,
            "recorded": trainer.recorded,
            "logged": trainer.logged,
            "selections": trainer.selections,
            "final": {n: p.detach().double().clone() for n, p in full_state.items()},
            "betas": [trainer.clip_params.beta1, trainer.clip_params.beta2],
            "world": trainer.accelerator.num_processes,
        },
        out_dir / f"{scenario['name']}.rank{rank}.pt",
    )


def main() -> None:
    warnings.filterwarnings("ignore")  # in the launched worker only: importing this module leaves pytest's filters
    model_dir, out_dir, scenarios = sys.argv[1], Path(sys.argv[2]), json.loads(Path(sys.argv[3]).read_text())
    for scenario in scenarios:
        run(model_dir, out_dir, scenario)


if __name__ == "__main__":
    main()
