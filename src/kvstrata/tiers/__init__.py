"""Tier storage and movement: the device (L1) and host (L2) pools, the transfer module (the only
code that copies KV between tiers), copy tickets and the commit frontier, write-through and
load-back, which drive the tree's residency."""
