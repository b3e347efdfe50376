"""The optimizer catalogue. Importing this package loads no framework."""

from optimizers.registry import register

__all__ = ["register"]
