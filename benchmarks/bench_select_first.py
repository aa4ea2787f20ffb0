"""Select first, then compute: the cost of one generation step with over-generation, before and after.

    python benchmarks/bench_select_first.py                 # CPU, the tiny recipe's model, cegppo_oversampling 2.0
    python benchmarks/bench_select_first.py --beta 0.04     # with the reference-model pass too

Before (`--mode compute-first`, what the trainer did until issue 29): TRL's old-log-prob pass (and reference pass when
beta > 0) ran on every generated row, `cegppo_oversampling` times the training batch. After (the default): it runs on
the training rows only. Both modes run side by side in one process on the same model, prompts and seeds
(interleaved repetitions, medians); the generated rows, the rows trained on and their advantages are checked equal.
Printed: the time of the old (+ reference) passes and of the whole `_generate_and_score_completions`, per mode.

Measured on the 2-core CPU machine of issue 29 while other jobs ran (load average 9-12, so absolute times are inflated;
the modes alternate, so the ratios hold): 128 generated rows, 64 trained, max_completion_length 16,
  beta 0    (5 repeats): passes 13.69 s -> 5.37 s (0.39), generation step 40.19 s -> 24.69 s (0.61)
  beta 0.04 (3 repeats): passes 27.53 s -> 12.67 s (0.46), generation step 56.71 s -> 32.72 s (0.58)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch
from datasets import Dataset
from trl import GRPOTrainer

from cegppo_trl import CEGPPOConfig, CEGPPOTrainer
from cegppo_trl.tiny_model import build_tiny_model, build_tiny_tokenizer, save_tiny


warnings.filterwarnings("ignore")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16, help="per_device_train_batch_size (x steps_per_generation 4)")
    p.add_argument("--oversampling", type=float, default=2.0)
    p.add_argument("--completion-len", type=int, default=16, help="max_completion_length (the tiny recipe's 16)")
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=5)
    return p.parse_args()


def build(args, output_dir: str) -> CEGPPOTrainer:
    tokenizer = build_tiny_tokenizer()
    model = save_tiny(build_tiny_model(tokenizer), tokenizer, f"{output_dir}/tiny")  # beta > 0 loads it by name
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a}+{b}? Put the final answer in \\boxed{{}}."}]}
        for a in range(20)
        for b in range(20)
    ]
    config = CEGPPOConfig(
        output_dir=output_dir, use_cpu=not torch.cuda.is_available(), bf16=False, report_to="none",
        per_device_train_batch_size=args.rows, num_generations=4, steps_per_generation=4,
        gradient_accumulation_steps=1, max_completion_length=args.completion_len, temperature=1.0, beta=args.beta,
        cegppo_exclude_zero_advantage_groups=True, cegppo_oversampling=args.oversampling, seed=0,
    )  # fmt: skip

    def parity_reward(completions, **kwargs):  # about half the groups informative, independent of the mode
        return [float(sum(map(ord, str(c))) % 2) for c in completions]

    trainer = CEGPPOTrainer(
        model, parity_reward, config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    trainer.model.train()
    return trainer


class PassTimer:
    """Times TRL's `_get_per_token_logps_and_entropies` calls that do a forward pass (old and reference log-probs)."""

    def __init__(self):
        self.seconds, self.rows = 0.0, 0
        self._trl = GRPOTrainer._get_per_token_logps_and_entropies
        timer = self

        def timed(trainer, model, input_ids, *pargs, **kwargs):
            start = time.perf_counter()
            out = timer._trl(trainer, model, input_ids, *pargs, **kwargs)
            timer.seconds += time.perf_counter() - start
            timer.rows += input_ids.size(0)
            return out

        GRPOTrainer._get_per_token_logps_and_entropies = timed


def run_once(trainer, prompts, select_first: bool, timer: PassTimer):
    type(trainer)._old_policy_pass_after_selection = lambda self, mode: select_first and mode == "train"
    timer.seconds, timer.rows = 0.0, 0
    torch.manual_seed(0)
    start = time.perf_counter()
    batch = trainer._generate_and_score_completions(prompts)
    return batch, time.perf_counter() - start, timer.seconds, timer.rows


def main():
    args = parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    timer = PassTimer()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build(args, tmp)
        generated = round(args.rows * 4 * args.oversampling)
        dataset = trainer.train_dataset
        prompts = [dataset[i // 4] for i in range(generated)]  # groups of 4 completions of one prompt
        results = {True: [], False: []}
        batches = {}
        for _ in range(args.repeats):
            for select_first in (False, True):
                batch, total, passes, rows = run_once(trainer, prompts, select_first, timer)
                results[select_first].append((total, passes, rows))
                batches[select_first] = batch
        after, before = batches[True], batches[False]
        assert torch.equal(after["completion_ids"], before["completion_ids"])
        assert torch.equal(after["advantages"], before["advantages"])
        print(f"{generated} generated rows, {after['completion_ids'].size(0)} trained, beta={args.beta}, "
              f"max_completion_length={args.completion_len}, {args.repeats} repeats, torch threads "
              f"{torch.get_num_threads()}, device {trainer.accelerator.device}")  # fmt: skip
        for select_first, name in ((False, "compute first (before)"), (True, "select first (after)")):
            totals, passes, rows = zip(*results[select_first])
            print(f"  {name:24s} old/ref passes {statistics.median(passes):6.3f} s on {rows[0]} rows; "
                  f"_generate_and_score_completions {statistics.median(totals):6.3f} s")  # fmt: skip
        p_before = statistics.median(p for _, p, _ in results[False])
        p_after = statistics.median(p for _, p, _ in results[True])
        t_before = statistics.median(t for t, _, _ in results[False])
        t_after = statistics.median(t for t, _, _ in results[True])
        print(f"  after / before: passes {p_after / p_before:.2f}, generation step {t_after / t_before:.2f}")


if __name__ == "__main__":
    main()
