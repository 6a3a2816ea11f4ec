"""Private plumbing: nothing here is part of fleetroll's API."""
