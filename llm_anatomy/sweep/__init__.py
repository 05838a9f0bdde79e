"""Sweeps (a grid of prompt lengths, batch sizes, output lengths and precisions, measured point by point) and
the planner (predictions for other GPUs and Qwen3 sizes from the cost model and measured efficiencies)."""
