"""Sessions: where TaskGroups run. The only package that imports ``distributed``."""

from ._base import Session
from ._local import LocalSession

__all__ = ["LocalSession", "Session"]
