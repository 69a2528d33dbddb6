"""Auto-parallel planner: a cost model (FLOPs, collectives, memory) and a search over layouts."""

from .search import choose_layout, search

__all__ = ["choose_layout", "search"]
