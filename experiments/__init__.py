"""One-off studies: named variants of shipped configs (run.py) and their records (records/)."""
