"""Sample third-party axis plugin: the data axes through torch's DistributedDataParallel."""
