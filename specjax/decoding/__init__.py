"""Decoding: the sampling transform, lossless chain verification, shape buckets and device steps."""
