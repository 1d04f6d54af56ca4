"""kvstrata's disk tier as an SGLang HiCache storage backend (needs ``sglang`` installed).

``sglang.launch_server ... --enable-hierarchical-cache --hicache-storage-backend dynamic
--hicache-storage-backend-extra-config '{"backend_name": "kvstrata", "module_path":
"kvstrata.integrations.sglang", "class_name": "KvstrataStorage", "interface_v1": 1,
"dir": "/nvme/kvstrata", "budget_gib": 200}'`` (README, "SGLang"); add ``"remote":
"redis://HOST:PORT/0", "remote_gib": 64`` to put the shared Redis tier behind the disk.
"""

from .storage import KvstrataStorage

__all__ = ["KvstrataStorage"]
