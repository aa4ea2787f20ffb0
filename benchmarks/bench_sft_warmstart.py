"""The tiny model's SFT warm start: TRL's `SFTTrainer` (completion-only loss; what `tiny_model.sft_warmstart` uses)
against the hand-written loop it replaced (kept here as the reference), same model, data and schedule.

    python benchmarks/bench_sft_warmstart.py --threads 1 --steps 60 --repeats 2

Prints wall and CPU seconds of each, interleaved repetitions, and the ratios TRL / hand-written (medians).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from cegppo_trl.tiny_model import (
    arithmetic_sft_examples,
    build_tiny_model,
    build_tiny_tokenizer,
    load_rows,
    sft_warmstart,
)


warnings.filterwarnings("ignore")


def hand_written_sft(model, tokenizer, examples, steps, batch_size=64, lr=3e-3, seed=0):
    """The loop `sft_warmstart` had before it used SFTTrainer: AdamW (0.9, 0.98), linear warm-up then cosine decay
    to 10% of lr, batches drawn with replacement, token-mean cross-entropy over completion + eos."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    encoded = [
        (
            tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)[
                "input_ids"
            ],
            tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
        )
        for prompt, completion in examples
    ]
    ids = tokenizer.pad({"input_ids": [p + c for p, c in encoded]}, padding_side="right", return_tensors="pt")
    labels = tokenizer.pad(
        {"input_ids": [[-100] * len(p) + c for p, c in encoded]}, padding_side="right", return_tensors="pt"
    )["input_ids"]
    labels[ids["attention_mask"] == 0] = -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, max(1, min(50, steps // 10)), steps, min_lr_rate=0.1
    )
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(encoded), (batch_size,), generator=gen)
        width = int(ids["attention_mask"][idx].sum(1).max())
        logits = model(input_ids=ids["input_ids"][idx, :width], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels[idx, 1:width].reshape(-1), ignore_index=-100
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = build_tiny_tokenizer()
    examples = arithmetic_sft_examples(load_rows("builtin:arithmetic"))
    times = {"hand-written": [], "SFTTrainer": []}
    for _ in range(args.repeats):
        for name in times:
            model = build_tiny_model(tokenizer, seed=0)
            wall, cpu = time.perf_counter(), time.process_time()
            if name == "SFTTrainer":
                loss = sft_warmstart(model, tokenizer, examples, steps=args.steps, progress=False)["final_loss"]
            else:
                loss = hand_written_sft(model, tokenizer, examples, args.steps)
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
            print(
                f"{name}: wall {times[name][-1][0]:.1f} s, CPU {times[name][-1][1]:.1f} s, loss {loss:.3f}", flush=True
            )
    median = {name: [statistics.median(t[i] for t in values) for i in (0, 1)] for name, values in times.items()}
    ratio = [median["SFTTrainer"][i] / median["hand-written"][i] for i in (0, 1)]
    print(
        f"{args.steps} steps, {args.threads} threads; SFTTrainer / hand-written: wall {ratio[0]:.2f}, CPU {ratio[1]:.2f}"
    )


if __name__ == "__main__":
    main()
