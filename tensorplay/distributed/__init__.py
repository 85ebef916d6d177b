"""tensorplay's counterpart of ``torch.distributed``: the algorithms it makes observable."""
