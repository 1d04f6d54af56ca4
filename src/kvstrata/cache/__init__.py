"""The prefix cache core: token keys, the radix tree and its checks, eviction order and planning,
and the replicated page allocators. Imports nothing above ``kvstrata.config`` and friends."""
