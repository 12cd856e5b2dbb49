"""The pure core: plans and state machines. No I/O, no host imports; data in, data out."""
