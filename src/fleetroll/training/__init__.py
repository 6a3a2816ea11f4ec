"""Training data from rollouts: trajectories, groups, and the rows a trainer reads."""
