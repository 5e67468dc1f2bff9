"""Drafters: each proposes a block of draft tokens with the exact distributions they came from."""
