"""Notebook 00: what this machine is, what it can run, how fast it can go."""
from __future__ import annotations

RULES: dict = {}
