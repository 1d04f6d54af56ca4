"""Run Triton kernels with runtime loop bounds in Triton's CPU interpreter (for tests only).

Triton 3.6's interpreter turns a scalar into a Python index with ``int()`` on a one-element array,
which numpy >= 2.4 refuses, so a kernel loop bounded by an argument, a program id or a loaded
value fails there. :func:`patch_loop_bounds` makes that conversion take the element instead.
"""

from __future__ import annotations

from typing import Any


def patch_loop_bounds() -> None:
    """Patch the interpreter (call before the first kernel launch; idempotent)."""
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "kvstrata_patched", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.kvstrata_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
