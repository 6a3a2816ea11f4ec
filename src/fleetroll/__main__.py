"""``python -m fleetroll``: the same as the ``fleetroll`` command."""

from fleetroll.cli import main

main()
