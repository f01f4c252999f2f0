"""Shared test helpers: tiny offline models and a multi-process gloo harness."""
