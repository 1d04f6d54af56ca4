"""Tier storage and movement: the device (L1) and host (L2) pools, the transfer module (the only
code that copies KV between device and host), copy tickets and the commit frontier, write-through
and load-back, which drive the tree's residency; and the disk tier (L3): content addresses
(``page_hash``), slab format (``disk_format``), index (``disk_index``), slots (``disk_slots``),
buffers and events (``disk_buffers``, ``disk_events``), the spill pipeline (``disk_spill``),
verified reads (``disk_read``), the store (``disk_config``, ``disk_store``) and its fsck
(``disk_audit``)."""
