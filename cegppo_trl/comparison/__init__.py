"""`cegppo-compare`: several arms (GRPO, DAPO, CE-GPPO, any beta pair) trained from one start model for several
seeds with everything else equal, every model measured on the same held-out problems, compared with paired
statistics; resumable (docs/comparison.md).

- `settings`: the command's arguments, the arms, the checks made before any work;
- `jobs`: the start's measurement and one training run (resumed from its newest finite checkpoint), each in its own
  process;
- `report`: the statistics, the Markdown table, the figure and where the time went (pure Python but the figure).
"""
