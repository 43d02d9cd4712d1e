"""The fleet controller: placement from node status, published on the broker."""
