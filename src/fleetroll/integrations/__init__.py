"""Trainers plug in: one module per trainer, each a thin adapter over one shared core.

- :mod:`fleetroll.integrations.core`: what every adapter uses: fleetroll
  opened as ``fleetroll run`` opens it (a :class:`~fleetroll.RolloutPool` on
  Fleet, or on the embedded emulator when no Fleet is configured), a list of
  ``(task_key, sample_index)`` requests run as one batch and answered one
  trainer row per request, exactly; async (:class:`~fleetroll.integrations.core.Rollouts`)
  or from synchronous code, on a loop of its own
  (:class:`~fleetroll.integrations.core.BlockingRollouts`).
- :mod:`fleetroll.integrations.trl`: TRL's ``GRPOTrainer(rollout_func=...)``.
- :mod:`fleetroll.integrations.verl`: verl's ``AgentLoopBase`` (``@register("fleetroll")``).
- :mod:`fleetroll.integrations.skyrl`: SkyRL's ``GeneratorInterface`` (Python 3.12).
- :mod:`fleetroll.integrations.verifiers`: a verifiers ``Environment`` (prime-rl's).

Each adapter needs its trainer installed (the ``train`` extra for TRL; the
``verl``, ``skyrl`` and ``verifiers`` extras for the others);
importing this package imports none of them.
"""
