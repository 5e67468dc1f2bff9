"""Command-line programs of specjax (the console scripts in pyproject.toml point at their `main`)."""
