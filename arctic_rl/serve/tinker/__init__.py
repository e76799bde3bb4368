"""The Tinker API over the service's core: its routes, wire format, batches, losses and operation queue."""
