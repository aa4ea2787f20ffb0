"""The offline demo (`cegppo-demo`) and what it is built from besides the library's tiny model
(`cegppo_trl.tiny_model`): the exact entropy toy (`.toy`) and run plots (`.plotting`, `cegppo-plot`). It uses the
library; nothing in the library imports it."""
