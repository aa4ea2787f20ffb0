"""The offline demo (`cegppo-demo`: `.run`, the exact entropy toy `.toy`, the tiny-LM runs `.lm`) and run plots
(`.plotting`, `cegppo-plot`). It uses the library; nothing in the library imports it."""
