"""Hugging Face integration layer for the elixir runtime."""
