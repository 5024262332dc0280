"""Integrations with the PyTorch ecosystem (Lightning, Hugging Face). Each imports its framework lazily."""
