"""The job engine: steps and drives that the CLI and the service call.

A layer between the pool and the commands: :func:`~fleetroll.jobs.job.run_job`
runs a batch (or a run of steps, :mod:`~fleetroll.jobs.steps`) on the Fleet
:func:`~fleetroll.jobs.fleet.open_fleet` picks, driving it
(:mod:`~fleetroll.jobs.drive`: journal, early stop, signals) to a
:class:`~fleetroll.jobs.report.JobReport`; :mod:`~fleetroll.jobs.command` adds
the telemetry and policy a command's job needs. What a job says and shows goes
to a :class:`~fleetroll.jobs.output.JobOutput` (the CLI's console); the model
of its progress is :mod:`~fleetroll.jobs.progress`. No click, no rich: the
CLI keeps the options, the console and the exit codes.
"""
