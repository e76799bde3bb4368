"""Several training ranks behind one front: ``RankedCore``, the rank processes' handler, and a batch split between ranks."""
