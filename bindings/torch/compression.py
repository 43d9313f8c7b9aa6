"""shoal.torch's name of the gossip compressors (`shoal.compression`: one implementation for
numpy arrays and torch tensors, on the tensor's device; docs/design.md §21)."""
from shoal.compression import (Cast, Compressor, Identity, Int4, Int8, RandomK, TopK, by_name,  # noqa: F401
                               _Quantized)

__all__ = ["Compressor", "Identity", "Cast", "Int8", "Int4", "TopK", "RandomK", "by_name"]
