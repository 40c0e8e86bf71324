"""The KV cache's bookkeeping: the block pool, the prefix keys, the window pool, the host
and disk tiers, the events routers read, and how many blocks fit."""
