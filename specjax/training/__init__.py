"""Drafter training: data preparation (chat loss masks, anchors, block layout), losses, trainer."""
