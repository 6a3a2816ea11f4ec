"""The ``fleetroll`` command line: every command."""
