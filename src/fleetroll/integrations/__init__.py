"""Trainers plug in: one module per trainer, each a thin adapter over one shared core.

- :mod:`fleetroll.integrations.core`: what every adapter uses: fleetroll
  opened as ``fleetroll run`` opens it (a :class:`~fleetroll.RolloutPool` on
  Fleet, or on the embedded emulator when no Fleet is configured), a list of
  ``(task_key, sample_index)`` requests run as one batch and answered one
  trainer row per request, exactly; async (:class:`~fleetroll.integrations.core.Rollouts`)
  or from synchronous code, on a loop of its own
  (:class:`~fleetroll.integrations.core.BlockingRollouts`).
- :mod:`fleetroll.integrations.trl`: TRL's ``GRPOTrainer(rollout_func=...)``.

Each adapter needs its trainer installed (the ``train`` extra for TRL);
importing this package imports none of them.
"""
