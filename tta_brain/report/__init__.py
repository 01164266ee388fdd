"""Results of a tree of runs: RESULTS.md, tables, plots, method tags."""
