"""kvstrata's tiers inside other serving engines (``integrations.sglang``: an SGLang HiCache
storage backend). Each subpackage imports its engine; kvstrata itself never needs one."""
