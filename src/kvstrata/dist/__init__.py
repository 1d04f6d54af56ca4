"""Context parallelism: the rank group (the one place collectives live), the commit frontier
across ranks, attention under CP, and the launcher that starts ranks."""
