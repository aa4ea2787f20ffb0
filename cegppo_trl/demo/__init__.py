"""The offline demo (`cegppo-demo`) and what it is built from: the tiny model (`.tiny`), the exact entropy toy
(`.toy`) and run plots (`.plotting`, `cegppo-plot`). It uses the library; nothing in the library imports it."""
