"""The prefill engine: a scheduler (:class:`Engine`) over one rank's cache hierarchy.

``engine.py`` keeps queues, admission, chunking, the forward and outcomes; ``hierarchy.py`` owns
the tree and the tiers and makes every call that moves pages between them; ``disk_wait.py`` parks
requests behind disk reads; ``request.py`` holds the request records; ``config.py`` the sizes.
"""

from .config import EngineConfig
from .engine import Engine
from .hierarchy import CacheHierarchy
from .request import Finished

__all__ = ["CacheHierarchy", "Engine", "EngineConfig", "Finished"]
