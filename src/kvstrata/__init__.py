"""kvstrata: a page-granular, tiered, context-parallel prefix KV cache for LLM prefill."""

from __future__ import annotations

__version__ = "0.1.0"
