"""Storage tiers below the HBM cache, split by how long each kind of state is worth keeping.

* :class:`DiskPageTier`: global KV pages (a few hundred bytes per token, reused across turns for days), as
  content-addressed, checksummed files; 72-hour retention by last use and an LRU byte budget.
* :class:`HostStatePool`: idle sequences' SWA state (rings and compressor tails, worth minutes), as CPU copies in host
  memory; 10-minute TTL by last use and an LRU byte budget. Past that, bounded replay rebuilds the state.

tier = DiskPageTier("/var/cache/csa2/kv", max_bytes=200 << 30)
key = page_key("v4.1-flash@<weights digest>/p64", source=2, chain=chain_digest)
tier.put(key, PagePayload.from_pool(cache.groups[2], page_id))
page = tier.get(key, out=...)  # None on a miss; a page is returned only whole and checksummed
pool = HostStatePool(max_bytes=8 << 30)
pool.put(session_id, *sequence_state(cache, seq))  # park an idle sequence's rings and tails
entry = pool.pop(session_id)  # None past the TTL: bounded replay rebuilds the state instead
restore_sequence_state(cache, new_seq, entry.tensors, entry.meta)

The paged cache (:mod:`model.paged`) copies pages and state rows in and out; these tiers only store bytes.
"""

from model.tiers.disk import DiskPageTier, SweepReport
from model.tiers.host import HostEntry, HostStatePool, state_bytes
from model.tiers.keys import page_key
from model.tiers.pagefile import CorruptPage, PagePayload, decode_page, encode_page
from model.tiers.state import restore_sequence_state, sequence_state
from model.tiers.stats import TierDegradedWarning, TierStats

__all__ = [
    "CorruptPage",
    "DiskPageTier",
    "HostEntry",
    "HostStatePool",
    "PagePayload",
    "SweepReport",
    "TierDegradedWarning",
    "TierStats",
    "decode_page",
    "encode_page",
    "page_key",
    "restore_sequence_state",
    "sequence_state",
    "state_bytes",
]
