"""kvtier's benchmarks (``kvtier bench ...``): ratios of kvtier over plain baselines, measured side by side."""
