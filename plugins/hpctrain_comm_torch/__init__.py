"""torch.distributed communicator backend (gloo on CPU, nccl on GPU)."""
