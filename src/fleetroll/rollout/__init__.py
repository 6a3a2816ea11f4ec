"""One rollout: its state machine, stages, tools, transcript and sessions."""
