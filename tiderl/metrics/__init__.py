"""Metrics: sinks (JSONL, TensorBoard, progress bar) and summaries."""
