"""shoal.torch's name of the compressed gossip (`shoal.compressed_gossip`, one implementation
for numpy arrays and torch tensors; CHOCO-SGD, docs/design.md §21)."""
from shoal.compressed_gossip import CompressedGossip, GossipRound, by_name, default_step  # noqa: F401
