"""The federation tier: messages, client data, the local-training loop, topology, the in-process
simulator, checkpoints, and the Flower deployment (``federation.flower``)."""
