"""The planner: per-GPU memory and step time of every layout, ranked; the plan command."""
