"""Evaluation: acceptance metrics (DeepSpec and vLLM definitions) and confidence calibration metrics."""
