"""`cegppo-compare`: arms of one recipe (GRPO, DAPO, CE-GPPO, any beta pair) trained with `cegppo-train` for several
seeds, every model measured with `cegppo-eval`, compared with paired statistics; resumable (docs/comparison.md).

- `settings`: the command's flags, the recipe with its overrides, the arms, the checks made before any work;
- `runs`: the commands (training, measurement) and the launchers that run them: this machine, `accelerate launch`,
  SLURM;
- `report`: the statistics, the table and the figure, from the run folders alone.
"""
