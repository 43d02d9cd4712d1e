"""What both Ferry tiers speak: tensors, codecs, errors, repository, runtimes.

Nothing here opens a socket or runs an event loop.
"""
