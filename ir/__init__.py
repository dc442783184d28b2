"""Tensor-lifetime IR: ops, tensors, lifetimes and blocks traced from a torch model."""
