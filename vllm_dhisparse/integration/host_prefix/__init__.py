"""Prefix hits served from host memory (index.py: scheduler half, store.py: worker half)."""
