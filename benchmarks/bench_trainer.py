"""CE-GPPO vs TRL's GRPO (dapo) on the same model and batch: loss+backward time, peak memory, full training step.

    python benchmarks/bench_trainer.py                # CPU, tiny model (~1M parameters)
    python benchmarks/bench_trainer.py --hidden 256 --layers 6 --completion-len 128

Prints ratios CE-GPPO / GRPO measured side by side in one run (interleaved repetitions, median). Goal: <= 1.01.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
import warnings

import torch
from datasets import Dataset
from harness import profiled_peak, sync
from trl import GRPOConfig, GRPOTrainer

from cegppo_trl import CEGPPOConfig, CEGPPOTrainer
from cegppo_trl.tiny_model import build_tiny_model, build_tiny_tokenizer


warnings.filterwarnings("ignore")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="completions per micro-batch")
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--completion-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--train-steps", type=int, default=8)
    p.add_argument("--train-repeats", type=int, default=2)
    return p.parse_args()


def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_config(cls, output_dir, args, **overrides):
    values = dict(
        output_dir=output_dir,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=args.completion_len,
        gradient_accumulation_steps=1,
        steps_per_generation=4,
        max_steps=args.train_steps,
        learning_rate=1e-4,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        loss_type="dapo",
    )
    values.update(overrides)
    return cls(**values)


def make_batch(tokenizer, trainer, args, seed=0):
    gen = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    b, p, c = args.batch, args.prompt_len, args.completion_len
    completion_ids = torch.randint(3, vocab, (b, c), generator=gen)
    lengths = torch.randint(c // 2, c + 1, (b,), generator=gen)
    batch = {
        "prompt_ids": torch.randint(3, vocab, (b, p), generator=gen),
        "prompt_mask": torch.ones(b, p, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": (torch.arange(c).unsqueeze(0) < lengths.unsqueeze(1)).long(),
        "advantages": torch.randn(b, generator=gen),
    }
    batch["num_items_in_batch"] = batch["completion_mask"].sum() * 4
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1).to(device())
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1).to(device())
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, c)
    batch["old_per_token_logps"] = logps.cpu() + 0.3 * torch.randn(logps.shape, generator=gen)
    return {k: v.to(device()) for k, v in batch.items()}


def loss_backward(trainer, batch):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    return loss


def timed(trainer, batch):
    sync(device())
    start = time.perf_counter()
    loss_backward(trainer, batch)
    sync(device())
    return time.perf_counter() - start


def peak_memory(trainer, batch) -> float:
    """Peak bytes allocated during loss+backward above the level before it (CUDA counters, or the harness's profiled
    CPU allocations)."""
    trainer.model.zero_grad(set_to_none=True)
    if not torch.cuda.is_available():
        return profiled_peak(lambda: loss_backward(trainer, batch))
    sync(device())
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss_backward(trainer, batch)
    sync(device())
    return torch.cuda.max_memory_allocated() - base


def main():
    args = parse_args()
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer()
    base = build_tiny_model(tokenizer, hidden_size=args.hidden, num_layers=args.layers).to(device())
    n_params = sum(p.numel() for p in base.parameters())
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "solution": str(a + b)}
            for a in range(16)
            for b in range(16)
        ]
    )

    def reward(completions, **kwargs):
        return [1.0 if len(c[0]["content"]) % 2 else -1.0 for c in completions]

    tmp = tempfile.mkdtemp()
    trainers = {
        "grpo": GRPOTrainer(
            copy.deepcopy(base), reward, make_config(GRPOConfig, tmp + "/g", args), dataset, processing_class=tokenizer
        ),
        "cegppo": CEGPPOTrainer(
            copy.deepcopy(base),
            reward,
            make_config(CEGPPOConfig, tmp + "/c", args),
            dataset,
            processing_class=tokenizer,
        ),
    }
    for t in trainers.values():
        t.model.train()
        t.current_gradient_accumulation_steps = 1
    batch = make_batch(tokenizer, trainers["grpo"], args)

    for t in trainers.values():  # warm-up
        for _ in range(2):
            loss_backward(t, batch)
    times = {name: [] for name in trainers}
    for _ in range(args.repeats):  # interleaved so machine noise hits both alike
        for name, t in trainers.items():
            times[name].append(timed(t, batch))
    memory = {name: peak_memory(t, batch) for name, t in trainers.items()}
    trainers["cegppo"]._device_metrics.flush("train", trainers["cegppo"]._metrics["train"])
    clip = trainers["cegppo"]._metrics["train"]
    clipped = clip["cegppo/beta1_token_frac"][-1] + clip["cegppo/beta2_token_frac"][-1]

    step_times = {name: [] for name in trainers}
    for rep in range(args.train_repeats):
        for name, (trainer_cls, config_cls) in {
            "grpo": (GRPOTrainer, GRPOConfig),
            "cegppo": (CEGPPOTrainer, CEGPPOConfig),
        }.items():
            trainer = trainer_cls(
                copy.deepcopy(base),
                reward,
                make_config(config_cls, f"{tmp}/{name}{rep}", args),
                dataset,
                processing_class=tokenizer,
            )
            trainer.train()
            per_step = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
            step_times[name].extend(per_step[1:])  # drop the first step (warm-up)

    med = {k: statistics.median(v) for k, v in times.items()}
    step = {k: statistics.median(v) for k, v in step_times.items()}
    print(
        f"device={device().type} params={n_params / 1e6:.2f}M batch={args.batch}x{args.completion_len} tokens "
        f"clipped_token_frac={clipped:.3f} threads={torch.get_num_threads()}"
    )
    print(f"{'measure':<28}{'GRPO (dapo)':>14}{'CE-GPPO':>14}{'ratio':>10}")
    print(
        f"{'loss+backward median (ms)':<28}{med['grpo'] * 1e3:>14.2f}{med['cegppo'] * 1e3:>14.2f}"
        f"{med['cegppo'] / med['grpo']:>10.3f}"
    )
    print(
        f"{'loss+backward peak (MiB)':<28}{memory['grpo'] / 2**20:>14.2f}{memory['cegppo'] / 2**20:>14.2f}"
        f"{memory['cegppo'] / memory['grpo']:>10.3f}"
    )
    print(
        f"{'full train step median (s)':<28}{step['grpo']:>14.3f}{step['cegppo']:>14.3f}"
        f"{step['cegppo'] / step['grpo']:>10.3f}"
    )


if __name__ == "__main__":
    main()
