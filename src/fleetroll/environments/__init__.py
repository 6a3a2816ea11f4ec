"""Where a rollout's environment lives: the provider protocol and its providers."""
