"""``python -m fleetroll``: the same as the ``fleetroll`` command."""

from fleetroll.cli.main import main

if __name__ == "__main__":
    main()
