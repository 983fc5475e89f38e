"""The engine behind :class:`musacache.Cache`: the directory, placement and eviction,
the read and write paths (plan, move, commit), the storage path and the cache's tasks."""
