# /// script
# requires-python = ">=3.10"
# dependencies = [
#     "cegppo-trl",  # this repository: `pip install -e .` (or `pip install "cegppo-trl @ <path or git URL>"`)
#     "trl>=1.16,<1.17",
#     "peft",
#     "math-verify",
# ]
# ///
"""Train a model with CE-GPPO: a thin launcher for `cegppo_trl.scripts.train` (the `cegppo-train` command).

Every option is a field of `CEGPPOScriptArguments`, `cegppo_trl.CEGPPOConfig` (TRL's `GRPOConfig` + CE-GPPO) or
`trl.ModelConfig`, given on the command line or in a YAML recipe with ``--config`` (command-line values win).

CPU smoke test (no GPU, nothing downloaded)::

    python examples/train_cegppo.py --config recipes/tiny/cegppo/config_cpu.yaml

The paper's 1.5B run on one node of 8 GPUs (DeepSpeed ZeRO-2, vLLM colocated)::

    accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 8 \\
        examples/train_cegppo.py --config recipes/DeepSeek-R1-Distill-Qwen-1.5B/cegppo/config_paper.yaml

The 7B run (ZeRO-3), and LoRA on one GPU::

    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 8 \\
        examples/train_cegppo.py --config recipes/DeepSeek-R1-Distill-Qwen-7B/cegppo/config_paper.yaml
    accelerate launch --config_file accelerate_configs/single_gpu.yaml \\
        examples/train_cegppo.py --config recipes/DeepSeek-R1-Distill-Qwen-1.5B/cegppo/config_lora.yaml

Several nodes (ZeRO-3), with vLLM in server mode on its own GPUs (`trl vllm-serve`)::

    # on the vLLM node (10.0.0.9):
    trl vllm-serve --model deepseek-ai/DeepSeek-R1-Distill-Qwen-7B --tensor_parallel_size 2 --data_parallel_size 4
    # on each of the 2 training nodes (machine_rank 0 and 1; 10.0.0.1 is node 0):
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_machines 2 --num_processes 16 \\
        --machine_rank 0 --main_process_ip 10.0.0.1 --main_process_port 29500 \\
        examples/train_cegppo.py --config recipes/DeepSeek-R1-Distill-Qwen-7B/cegppo/config_paper.yaml \\
        --vllm_mode server --vllm_server_host 10.0.0.9 --gradient_accumulation_steps 8 --steps_per_generation 64

See docs/launch.md for details.
"""

import sys

from cegppo_trl.scripts.train import main


if __name__ == "__main__":
    sys.exit(main())
