"""A plugin entry point that fails on import, to prove the others still load."""

raise ImportError("fixture plugin is broken on purpose")
