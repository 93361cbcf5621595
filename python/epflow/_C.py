"""Thin wrappers over the ops of the compiled library (_epflow_torch.so, loaded by epflow)."""
import torch


def get_unique_id() -> bytes:
    """A fresh ncclUniqueId (128 bytes): make it on one rank, broadcast it, create handles."""
    return bytes(torch.ops.epflow.get_unique_id().tolist())
