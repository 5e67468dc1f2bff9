"""Runnable training programs: `python -m train.<name> --help`."""
