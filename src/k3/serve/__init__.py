"""Inference and serving: generation engine, OpenAI-compatible server, HF transformers integration."""
