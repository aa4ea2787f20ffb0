"""Command-line scripts of cegppo_trl (`cegppo-train`)."""
