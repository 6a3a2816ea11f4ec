"""Fleet as an environment provider: everything about Fleet's platform and SDK."""
