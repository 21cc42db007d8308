"""A package next to the job file (its code travels with the steps, as the helper module's does)."""

from .update import descend

__all__ = ["descend"]
